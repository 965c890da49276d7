"""Whether a job's processes can import the function they are sent.

A function of an importable module travels by reference (cloudpickle, as submitit sends it):
the job's process imports its module by name. It starts in the submission's folder with its
environment, so it sees that folder, ``PYTHONPATH`` and the installed packages, but not what
this process added to ``sys.path`` (the folder of the script that submits, a notebook's
``sys.path.insert``). A module found only that way would fail in every task after the
queue wait; it is refused before anything is queued.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from hpc_ddp.runtime.errors import HpcDdpError

#: Where a fresh interpreter started like a job's (``python -m`` from the submission's folder)
#: finds a top-level module: its file, or nothing.
_FIND = (
    "import importlib.util, sys\n"
    "spec = importlib.util.find_spec(sys.argv[1])\n"
    "print(spec.origin if spec is not None and spec.origin else '')\n"
)


def module_file(function: object) -> tuple[str, Path] | None:
    """The top-level module through which ``function`` is imported by name, and the file
    this process imported it from; None where it travels by value (``__main__``, a module
    registered with ``cloudpickle.register_pickle_by_value``) or has no file."""
    import cloudpickle

    name = getattr(function, "__module__", None) or type(function).__module__
    if not isinstance(name, str) or name == "__main__":
        return None
    by_value = cloudpickle.list_registry_pickle_by_value()
    parts = name.split(".")
    if any(".".join(parts[: depth + 1]) in by_value for depth in range(len(parts))):
        return None
    top = sys.modules.get(parts[0])
    file = getattr(top, "__file__", None)
    return (parts[0], Path(file).resolve()) if file else None


def found_by_job(top: str, workdir: Path, environ: Mapping[str, str]) -> Path | str | None:
    """The file a job's interpreter would import ``top`` from (None: not found; a string:
    the look-up itself failed, with why)."""
    try:
        result = subprocess.run(
            [sys.executable, "-c", _FIND, top],
            cwd=workdir,
            env=dict(environ),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{type(error).__name__}: {error}"
    if result.returncode != 0:
        return result.stderr.strip()[-300:] or f"exit code {result.returncode}"
    origin = result.stdout.strip()
    return Path(origin).resolve() if origin else None


def check_importable(
    function: object, what: str, workdir: Path, environ: Mapping[str, str]
) -> None:
    """Refuse ``function`` when a job started in ``workdir`` with ``environ`` would not
    import it from the file this process did (``what`` names the job kind in the error)."""
    found_here = module_file(function)
    if found_here is None or found_here[0] == __name__.partition(".")[0]:
        return  # by value, or the toolkit's own, which every task imports whatever it runs
    top, here = found_here
    there = found_by_job(top, workdir, environ)
    if isinstance(there, str) or there == here:
        return  # the look-up failed: the task's own error will say more than a guess
    root = here.parent.parent if here.name == "__init__.py" else here.parent
    fix = (
        f"submit from {root}, put it on the path (export PYTHONPATH={root}), or install "
        "your code as a package (pip install -e .)"
    )
    if there is None:
        raise HpcDdpError(
            f"{what} would import module {top!r} by name, starting in {workdir}, where Python "
            f"cannot find it: this process found it in {root}, which only its own sys.path "
            "holds (the folder of the script that submits, or a sys.path.insert)",
            fix,
        )
    raise HpcDdpError(
        f"{what} would import module {top!r} from {there}, not from {here} as this process "
        f"does (a job looks in {workdir}, then PYTHONPATH, then the installed packages)",
        f"{fix}; or remove the other copy",
    )
