"""The sweep's record: what it runs, how, and each task's index, settings, state, run,
MLflow run and final metrics.

``<sweep dir>/sweep.json`` holds what the sweep runs, written once at submit (and again only
for a change to the whole sweep, such as its MLflow parent run). What changes as tasks run
lives beside it (:mod:`hpc_ddp.sweep.taskstate`): :func:`read_manifest` returns the two
joined, as one record. Each file is replaced through a temporary file renamed into place,
under an exclusive lock beside it, so a reader sees the old file or the new one, never a
part, and no change is lost.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.safefiles import make_dirs, replace_bytes
from hpc_ddp.sweep import taskstate

MANIFEST_FILE = "sweep.json"
#: 2: what changes lives beside sweep.json; 1 (read too): everything in it.
FORMAT = 2
_READ_FORMATS = (1, 2)
#: A task's states in the record. `sweep status` adds what Slurm sees (requeued, lost).
STATES = ("pending", "running", "requeued", "finished", "failed", "stopped")
ENDED = ("finished", "failed", "stopped")


def run_dir_of(data: Mapping[str, Any], task: Mapping[str, Any]) -> Path:
    """A task's run directory: ``<output_dir>/<sweep name>/task-NNN``."""
    return Path(str(data["output_dir"])) / str(data["name"]) / str(task["run_id"])


def manifest_path(sweep_dir: Path) -> Path:
    return sweep_dir / MANIFEST_FILE


def read_manifest(sweep_dir: Path) -> dict[str, Any]:
    """The record of the sweep in ``sweep_dir``, what changed as it ran included;
    HpcDdpError when there is none, it is not a sweep's or a part of it is damaged."""
    data = _read_definition(sweep_dir)
    _join_changes(data, taskstate.read_arrays(sweep_dir), taskstate.read_states(sweep_dir))
    _refuse_problem(manifest_path(sweep_dir), data)
    return data


def read_task(sweep_dir: Path, index: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """sweep.json, and task ``index`` with its own state: what a task's processes read
    (never every task's state, which grows with the sweep)."""
    data = _read_definition(sweep_dir)
    if not 0 <= index < len(data["tasks"]):
        raise HpcDdpError(
            f"array task {index} of a sweep of {len(data['tasks'])} tasks", "resubmit the sweep"
        )
    task = data["tasks"][index]
    task.update(taskstate.read_state(sweep_dir, task["run_id"]))
    return data, task


def _join_changes(
    data: dict[str, Any], arrays: list[Any], states: Mapping[str, Mapping[str, Any]]
) -> None:
    """Each task's own state over its definition; a task waiting to start takes its job
    from the newest array submitted for it since it was last reset."""
    data["arrays"] = [*data["arrays"], *arrays]
    tasks = data["tasks"]
    for task in tasks:
        if isinstance(task, dict) and task.get("run_id") in states:
            task.update(states[task["run_id"]])
    for position, array in enumerate(data["arrays"]):
        problem = _array_problem(array, len(tasks))
        if problem is not None:
            raise HpcDdpError(
                f"the sweep's array {position} is damaged: {problem}",
                f"restore {taskstate.ARRAYS_FILE} (or {MANIFEST_FILE}) from a copy",
            )
        for number in array["tasks"]:
            task = tasks[number]
            if task.get("state") == "pending" and position >= task.get("since_array", 0):
                task["job"] = f"{array['job_id']}_{number - array['offset']}"


def _array_problem(array: Any, task_count: int) -> str | None:
    if not isinstance(array, dict) or not isinstance(array.get("job_id"), str):
        return f"{str(array)[:60]!r} is not an array with a job id"
    offset, numbers = array.get("offset"), array.get("tasks")
    if not isinstance(offset, int) or not isinstance(numbers, list):
        return f"array {array['job_id'][:20]!r} has no offset or no task list"
    if not all(isinstance(n, int) and offset <= n < task_count for n in numbers):
        return f"array {array['job_id'][:20]!r} names a task the sweep does not have"
    return None


def _read_definition(sweep_dir: Path) -> dict[str, Any]:
    """sweep.json alone (checked): what the sweep runs."""
    path = manifest_path(sweep_dir)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        hint = "pass the folder `hpc-ddp sweep submit` printed: <run.output_dir>/<sweep name>"
        under_runs = Path("runs") / sweep_dir  # run.output_dir's default
        if not sweep_dir.is_absolute() and manifest_path(under_runs).is_file():
            hint = f"did you mean {under_runs}? Else {hint}"
        raise HpcDdpError(
            f"{sweep_dir} holds no sweep ({MANIFEST_FILE} is missing)", hint
        ) from None
    except (OSError, ValueError) as error:
        raise HpcDdpError(
            f"cannot read {path}: {error}", "the sweep's record is damaged; restore it"
        ) from None
    if not isinstance(data, dict) or data.get("format") not in _READ_FORMATS or "tasks" not in data:
        raise HpcDdpError(
            f"{path} is not a sweep record this version reads (format {FORMAT})",
            "use the hpc_ddp version that wrote it",
        )
    _refuse_problem(path, data)
    return data


def _refuse_problem(path: Path, data: Mapping[str, Any]) -> None:
    problem = record_problem(data)
    if problem is not None:
        raise HpcDdpError(
            f"{path} is damaged: {problem}",
            "restore sweep.json from a copy, or fix that field by hand (each task's "
            "run directory keeps its own record)",
        )


#: What each field of the record holds (a tuple: any of those types).
_RECORD_FIELDS: dict[str, Any] = {
    "name": str, "program": dict, "job": dict, "workdir": str, "output_dir": str,
    "concurrency": (int, type(None)), "metric": (str, type(None)), "mode": (str, type(None)),
    "tracking": (dict, type(None)), "arrays": list, "tasks": list,
}  # fmt: skip
_TASK_FIELDS: dict[str, Any] = {
    "index": int, "settings": dict, "run_id": str, "state": str, "attempts": int,
    "job": (str, type(None)), "mlflow_run_id": (str, type(None)), "final": dict,
    "error": (str, type(None)), "since_array": int, "overrides": list,
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


def write_manifest(sweep_dir: Path, data: dict[str, Any]) -> None:
    """Replace sweep.json whole (the caller holds the lock, or made the folder)."""
    data["updated"] = time.time()
    replace_bytes(manifest_path(sweep_dir), (json.dumps(data, indent=1) + "\n").encode())


def create_manifest(sweep_dir: Path, data: dict[str, Any]) -> None:
    """The first record of a new sweep in ``sweep_dir``."""
    make_dirs(sweep_dir)
    with taskstate.locked(sweep_dir):
        if manifest_path(sweep_dir).exists():
            raise HpcDdpError(
                f"{sweep_dir} already holds a sweep", "hpc-ddp sweep resume it, or rename yours"
            )
        write_manifest(sweep_dir, {"format": FORMAT, **data})


def update_definition(sweep_dir: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    """Apply ``change`` to sweep.json (what the whole sweep runs) under the lock, and write
    it; what its tasks do changes through :func:`update_tasks`, in time that does not grow
    with the sweep."""
    with taskstate.locked(sweep_dir):
        data = _read_definition(sweep_dir)
        change(data)
        write_manifest(sweep_dir, data)


def update_tasks(
    sweep_dir: Path, tasks: Iterable[Mapping[str, Any]], change: Callable[[dict[str, Any]], Any]
) -> int:
    """Apply ``change`` to what changes of each of ``tasks`` (state, attempts, job, final
    metrics, settings), as :func:`read_manifest` returned them; returns how many tasks of
    the sweep have ended."""

    def ended_in_the_record() -> list[str]:  # a record of format 1 keeps states in it
        tasks = _read_definition(sweep_dir)["tasks"]
        return [task["run_id"] for task in tasks if task["state"] in ENDED]

    return taskstate.update_tasks(sweep_dir, tasks, ENDED, change, ended_in_the_record)


def record_array(sweep_dir: Path, job_id: str, offset: int, tasks: list[int], script: str) -> None:
    """One job array submitted for ``tasks``: those waiting to start take its job id."""
    entry = {"job_id": job_id, "offset": offset, "tasks": tasks, "script": script}
    taskstate.append_array(sweep_dir, entry)


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
