"""mlflow imported lean, and its HTTP client's settings, for rank 0's tracking process.

The full mlflow install brings the data-science stack (pandas, numpy, scipy, pyarrow) and
imports it at ``import mlflow``, though logging a run's params, metrics, tags and files
never uses it: mlflow-skinny, the same client without these packages, makes the same calls.
Left out of the tracking process, they save about 0.4 s of its 1.3 s import, CPU that
training shares on a busy node (bench/README.md, section 6). Should an mlflow version want
one of them after all, :func:`let_in` makes them importable again and the call is made once
more.

Standard library only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

from hpc_ddp.runtime.import_gc import freeze_imports, hold_collection

#: Packages the tracking process leaves out until a call wants one.
LEFT_OUT = ("pandas", "numpy", "scipy", "pyarrow")


def import_mlflow() -> None:
    """Import mlflow and its SQL store's module now, with the garbage collector held and
    :data:`LEFT_OUT` left out (again with them if the import wants one). An mlflow that
    cannot be imported is left for the first call to report."""
    hold_collection()
    for name in LEFT_OUT:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]  # import raises ImportError
    try:
        try:
            _import()
        except ImportError:
            if not let_in():
                raise
            _import()
    except Exception:
        pass
    freeze_imports()


def let_in() -> bool:
    """Make the packages left out importable again; whether any was still left out."""
    left_out = [name for name in LEFT_OUT if name in sys.modules and sys.modules[name] is None]
    for name in left_out:
        del sys.modules[name]
    return bool(left_out)


def _import() -> None:
    import mlflow
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401


#: MLflow's HTTP client retries 7 times with a doubling backoff, minutes against a server
#: that is down; with these (unless the user set them) a failing call gives up in seconds.
MLFLOW_HTTP_SETTINGS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}


def mlflow_http_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """:data:`MLFLOW_HTTP_SETTINGS` that ``environ`` does not set (the user's values win)."""
    return {key: value for key, value in MLFLOW_HTTP_SETTINGS.items() if key not in environ}


def export_mlflow_http_settings(
    environ: MutableMapping[str, str] = os.environ,
) -> dict[str, str]:
    """Write :func:`mlflow_http_settings` into ``environ`` (MLflow reads them only from the
    environment); returns what was written."""
    written = mlflow_http_settings(environ)
    environ.update(written)
    return written
