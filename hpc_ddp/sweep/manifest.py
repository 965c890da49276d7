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
    problem = record_problem(data)
    if problem is not None:
        raise HpcDdpError(
            f"{path} is damaged: {problem}",
            "restore sweep.json from a copy, or fix that field by hand (each task's "
            "run directory keeps its own record)",
        )
    return data


#: What each field of the record holds (a tuple: any of those types).
_RECORD_FIELDS: dict[str, Any] = {
    "name": str, "program": dict, "job": dict, "workdir": str, "output_dir": str,
    "concurrency": (int, type(None)), "metric": (str, type(None)), "mode": (str, type(None)),
    "tracking": (dict, type(None)), "arrays": list, "tasks": list,
}  # fmt: skip
_TASK_FIELDS: dict[str, Any] = {
    "index": int, "settings": dict, "run_id": str, "state": str, "attempts": int,
    "job": (str, type(None)), "mlflow_run_id": (str, type(None)), "final": dict,
    "error": (str, type(None)),
}  # fmt: skip


#: Fields every record and every task holds; the others are checked where present.
_ALWAYS = ("name", "tasks", "index", "settings", "run_id", "state")


def _wrong(holder: Mapping[str, Any], fields: Mapping[str, Any], where: str) -> str | None:
    for key, kind in fields.items():
        if key not in holder and key not in _ALWAYS:
            continue
        value = holder.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{where}{key} holds {type(value).__name__} {str(value)[:40]!r}"
    return None


def record_problem(data: Mapping[str, Any]) -> str | None:
    """What in a sweep's record is not as hpc_ddp wrote it (None: nothing): every field a
    command reads, each task at its own index with text settings and a known state."""
    problem = _wrong(data, _RECORD_FIELDS, "")
    if problem is not None:
        return problem
    for position, task in enumerate(data["tasks"]):
        where = f"tasks[{position}]."
        if not isinstance(task, dict):
            return f"tasks[{position}] is a {type(task).__name__}, not a task"
        problem = _wrong(task, _TASK_FIELDS, where)
        if problem is not None:
            return problem
        if task["index"] != position:
            return f"{where}index is {task['index']}, at position {position}"
        if task["state"] not in STATES:
            return f"{where}state is {task['state'][:40]!r}, not one of {', '.join(STATES)}"
        if not all(isinstance(v, str) for v in [*task["settings"], *task["settings"].values()]):
            return f"{where}settings holds a value that is not text"
    return None


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
