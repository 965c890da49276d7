"""The sweep's record, ``<sweep dir>/sweep.json``: what it runs, how, and each task's index,
settings, state, run, MLflow run and final metrics.

Written as tasks change state, by whichever process changes it (the submitting command, a
task's first rank as it starts, the job script as the task ends): each change reads,
changes and replaces the whole file under an exclusive lock beside it, through a temporary
file renamed into place, so a reader sees the old record or the new one, never a part.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.safefiles import make_dirs, open_lock_file, replace_bytes

MANIFEST_FILE = "sweep.json"
FORMAT = 1
#: A task's states in the record. `sweep status` adds what Slurm sees (requeued, lost).
STATES = ("pending", "running", "requeued", "finished", "failed", "stopped")
ENDED = ("finished", "failed", "stopped")


def run_dir_of(data: Mapping[str, Any], task: Mapping[str, Any]) -> Path:
    """A task's run directory: ``<output_dir>/<sweep name>/task-NNN``."""
    return Path(str(data["output_dir"])) / str(data["name"]) / str(task["run_id"])


def manifest_path(sweep_dir: Path) -> Path:
    return sweep_dir / MANIFEST_FILE


def read_manifest(sweep_dir: Path) -> dict[str, Any]:
    """The record of the sweep in ``sweep_dir``; HpcDdpError when there is none or it is
    not a sweep's."""
    path = manifest_path(sweep_dir)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise HpcDdpError(
            f"{sweep_dir} holds no sweep ({MANIFEST_FILE} is missing)",
            "pass the folder `hpc-ddp sweep submit` printed: <run.output_dir>/<sweep name>",
        ) from None
    except (OSError, ValueError) as error:
        raise HpcDdpError(
            f"cannot read {path}: {error}", "the sweep's record is damaged; restore it"
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or "tasks" not in data:
        raise HpcDdpError(
            f"{path} is not a sweep record this version reads (format {FORMAT})",
            "use the hpc_ddp version that wrote it",
        )
    return data


@contextlib.contextmanager
def _locked(sweep_dir: Path) -> Iterator[None]:
    with open_lock_file(sweep_dir / f".{MANIFEST_FILE}.lock") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_manifest(sweep_dir: Path, data: dict[str, Any]) -> None:
    """Replace the record whole (the caller holds the lock, or made the folder)."""
    data["updated"] = time.time()
    replace_bytes(manifest_path(sweep_dir), (json.dumps(data, indent=1) + "\n").encode())


def create_manifest(sweep_dir: Path, data: dict[str, Any]) -> None:
    """The first record of a new sweep in ``sweep_dir``."""
    make_dirs(sweep_dir)
    with _locked(sweep_dir):
        if manifest_path(sweep_dir).exists():
            raise HpcDdpError(
                f"{sweep_dir} already holds a sweep", "hpc-ddp sweep resume it, or rename yours"
            )
        write_manifest(sweep_dir, {"format": FORMAT, **data})


def update_manifest(sweep_dir: Path, change: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """Apply ``change`` to the record under the lock and write it; returns the new record."""
    with _locked(sweep_dir):
        data = read_manifest(sweep_dir)
        change(data)
        write_manifest(sweep_dir, data)
    return data


def new_task(index: int, settings: dict[str, str], run_id: str) -> dict[str, Any]:
    return {
        "index": index,
        "settings": settings,
        "run_id": run_id,
        "state": "pending",
        "attempts": 0,
        "job": None,
        "mlflow_run_id": None,
        "final": {},
        "error": None,
        "updated": time.time(),
    }


def set_task(task: dict[str, Any], **values: Any) -> None:
    task.update(values, updated=time.time())


def run_id_for(index: int, count: int) -> str:
    """The run id (folder) of task ``index`` of ``count``: task-007, sorted as numbered."""
    return f"task-{index:0{max(3, len(str(count - 1)))}d}"
