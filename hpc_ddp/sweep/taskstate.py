"""What changes as a sweep runs, kept beside its record so no change rewrites the record.

``sweep.json`` holds what the sweep runs, written at submit. What changes later lives in
small files beside it, each written in time that does not grow with the sweep:

- ``arrays.jsonl``: one line per job array submitted (appended);
- ``state/task-NNN.json``: a task's state, attempts, job, final metrics (replaced whole,
  through a rename, by whichever process changes it: the task's first rank as it starts,
  its job script as it ends, ``sweep resume``);
- ``state/ended/task-NNN``: present while the task has ended, and ``state/ended.count``
  their number, so the last task to end sees that the sweep has without reading every
  task.

Every change holds the lock beside the record, so changes never interleave.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.safefiles import make_dirs, open_append, open_lock_file, replace_bytes

ARRAYS_FILE = "arrays.jsonl"
STATE_DIR = "state"
ENDED_DIR = "ended"
ENDED_COUNT = "ended.count"
LOCK_FILE = ".sweep.json.lock"
#: A task's fields that change as the sweep runs (the others are its definition).
CHANGING_FIELDS = (
    "state", "attempts", "job", "mlflow_run_id", "final", "error", "step", "settings",
    "overrides", "since_array", "updated",
)  # fmt: skip
_STATE_NAME = re.compile(r"(task-\d+)\.json")


@contextlib.contextmanager
def locked(sweep_dir: Path) -> Iterator[None]:
    """The sweep's lock, held for one change."""
    with open_lock_file(sweep_dir / LOCK_FILE) as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def append_array(sweep_dir: Path, entry: Mapping[str, Any]) -> None:
    """Record one submitted job array."""
    with locked(sweep_dir), open_append(sweep_dir / ARRAYS_FILE) as handle:
        handle.write(json.dumps(entry) + "\n")


def read_arrays(sweep_dir: Path) -> list[Any]:
    """The arrays recorded by :func:`append_array`, oldest first."""
    path = sweep_dir / ARRAYS_FILE
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    except OSError as error:
        raise _damaged(path, str(error)) from None
    try:
        return [json.loads(line) for line in lines if line.strip()]
    except ValueError as error:
        raise _damaged(path, f"a line is not JSON ({error})") from None


def read_states(sweep_dir: Path) -> dict[str, Any]:
    """Each task's changing fields by run id, for the tasks that have any."""
    folder = sweep_dir / STATE_DIR
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return {}
    states = {}
    for entry in entries:
        match = _STATE_NAME.fullmatch(entry.name)
        if match:
            states[match.group(1)] = _read_state(Path(entry.path))
    return states


def read_state(sweep_dir: Path, run_id: str) -> dict[str, Any]:
    """One task's changing fields ({} before it has any)."""
    path = sweep_dir / STATE_DIR / f"{run_id}.json"
    return _read_state(path) if path.exists() else {}


def update_tasks(
    sweep_dir: Path,
    tasks: Iterable[Mapping[str, Any]],
    ended: Iterable[str],
    change: Callable[[dict[str, Any]], Any],
    ended_in_the_record: Callable[[], Iterable[str]],
) -> int:
    """Apply ``change`` to each task's changing fields (``tasks`` as the record holds them;
    their own file wins where there is one) and write them; returns how many tasks of the
    sweep have ended (a state in ``ended``), never fewer than have: the count goes up
    before a task's end is marked and down after its mark is gone, so a process killed in
    between leaves it high (see :func:`recount`). ``ended_in_the_record``: the run ids the
    record itself says ended (a record of format 1), marked once when there is no count."""
    ended_states = set(ended)
    folder = sweep_dir / STATE_DIR
    make_dirs(folder / ENDED_DIR)
    with locked(sweep_dir):
        if not (folder / ENDED_COUNT).exists():
            for run_id in ended_in_the_record():
                if not (folder / f"{run_id}.json").exists():
                    (folder / ENDED_DIR / run_id).touch()
        count = _read_count(folder)
        for task in tasks:
            run_id = str(task["run_id"])
            path = folder / f"{run_id}.json"
            fields = _read_state(path) if path.exists() else {}
            current = {key: task[key] for key in CHANGING_FIELDS if key in task} | fields
            change(current)
            current["updated"] = time.time()
            replace_bytes(path, (json.dumps(current) + "\n").encode())
            marker = folder / ENDED_DIR / run_id
            was_ended, now_ended = marker.exists(), current.get("state") in ended_states
            if now_ended and not was_ended:
                count += 1
                _write_count(folder, count)
                marker.touch()
            elif was_ended and not now_ended:
                marker.unlink()
                count -= 1
                _write_count(folder, count)
        _write_count(folder, count)
        return count


def recount(sweep_dir: Path) -> int:
    """How many tasks have ended, from their marks (the count set right)."""
    folder = sweep_dir / STATE_DIR
    with locked(sweep_dir):
        count = len(os.listdir(folder / ENDED_DIR))
        _write_count(folder, count)
        return count


def _read_count(folder: Path) -> int:
    """How many tasks have ended: the count kept beside their marks, or (where it is
    missing or damaged) the marks counted."""
    try:
        return int((folder / ENDED_COUNT).read_text())
    except (OSError, ValueError):
        return len(os.listdir(folder / ENDED_DIR))


def _write_count(folder: Path, count: int) -> None:
    replace_bytes(folder / ENDED_COUNT, f"{count}\n".encode())


def _read_state(path: Path) -> dict[str, Any]:
    try:
        fields = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise _damaged(path, str(error)) from None
    if not isinstance(fields, dict):
        raise _damaged(path, f"it holds a {type(fields).__name__}, not a task's state")
    return {key: value for key, value in fields.items() if key in CHANGING_FIELDS}


def _damaged(path: Path, problem: str) -> HpcDdpError:
    return HpcDdpError(
        f"cannot read {path}: {problem}",
        "the sweep's record beside it is damaged: restore the file from a copy, or remove "
        "a task's state file to show that task as never started (its run directory keeps "
        "its own record)",
    )
