"""The run's own record in its directory, readable without MLflow or a server.

Rank 0 keeps two small files in ``<output_dir>/<name>/<run id>/``:

- ``status.json``: the state (running, requeued, finished, failed, stopped), the attempt
  count, the step and epoch reached, where the current attempt runs (host, pid, job id),
  replaced atomically at every log interval and at the end;
- ``metrics.jsonl``: one line per logged batch of metrics, ``{"step", "global_step",
  "epoch", "time", "metrics"}``, appended; before an attempt's first one, a line
  ``{"attempt", "from_step", "time"}`` says where the attempt's training state began, and
  readers drop the points earlier attempts logged after that step (a run restarted from an
  earlier checkpoint, or from nothing, supersedes them);
- ``tracking.json`` (when tracking is on): where the run is tracked (MLflow URI, experiment,
  run name, params, tags, and the MLflow run's id once known), so that
  ``hpc-ddp tracking sync`` can replay the record into MLflow after an outage.

``hpc-ddp runs`` and ``hpc-ddp plot`` read them. Writing is best effort: a full disk or a
lost mount costs the record, never the training.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.arguments import is_number
from hpc_ddp.runtime.safefiles import make_dirs, open_append, replace_bytes
from hpc_ddp.runtime.tracking.base import Tracker

STATUS_FILE = "status.json"
METRICS_FILE = "metrics.jsonl"
TRACKING_FILE = "tracking.json"
#: Each attempt's code and environment (:mod:`hpc_ddp.runtime.tracking.provenance`).
PROVENANCE_FILE = "provenance.json"

#: What a tracker's final status means for the run.
END_STATES = {"FINISHED": "finished", "FAILED": "failed", "KILLED": "stopped"}


def _parsed(text: str | None) -> dict[str, Any]:
    try:
        status = json.loads(text) if text else {}
    except ValueError:
        return {}
    return status if isinstance(status, dict) else {}


def read_status(run_dir: Path) -> dict[str, Any] | None:
    """The run's status.json, or None if it has none (or it cannot be read)."""
    try:
        text = (run_dir / STATUS_FILE).read_text()
    except OSError:
        return None
    return _parsed(text) or None


def read_tracked_run_id(run_dir: Path) -> str | None:
    """The MLflow run named in the run's tracking.json (None: none known)."""
    try:
        run_id = json.loads((run_dir / TRACKING_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return run_id if isinstance(run_id, str) and run_id else None


def read_metrics(run_dir: Path) -> Iterator[dict[str, Any]]:
    """The run's metrics.jsonl in order, the points a later attempt superseded left out; a
    torn last line (a killed writer) is skipped."""
    try:
        lines = (run_dir / METRICS_FILE).read_text().splitlines()
    except OSError:
        return
    yield from current_points(lines)


def last_logged(
    run_dir: Path, since_unix: float, before_unix: float, tail_bytes: int = 65536
) -> tuple[float, int] | None:
    """The time and global step of the newest interval logged from ``since_unix`` to before
    ``before_unix`` (an attempt's last sign of life, before the next attempt began), if that
    is the newest logged before ``before_unix``; None without one. Reads the file from its
    end, a window at a time: a long run's record is not read whole."""
    try:
        with (run_dir / METRICS_FILE).open("rb") as file:
            size = file.seek(0, os.SEEK_END)
            while True:
                start = max(0, size - tail_bytes)
                file.seek(start)
                lines = file.read(size - start).decode(errors="replace").splitlines()
                whole = lines if start == 0 else lines[1:]  # the first may be cut
                found = _newest_interval(whole, before_unix)
                if found is not None or start == 0:
                    break
                tail_bytes *= 2
    except OSError:
        return None
    return found if found is not None and found[0] >= since_unix else None


def _newest_interval(lines: list[str], before_unix: float) -> tuple[float, int] | None:
    for line in reversed(lines):
        entry = _parsed(line)
        logged, step = entry.get("time"), entry.get("global_step")
        if isinstance(logged, int | float) and isinstance(step, int) and logged < before_unix:
            return float(logged), step
    return None


def current_points(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The metric entries of ``lines`` that the run's final history holds: at an attempt's
    start line, the earlier attempts' points after its ``from_step`` are dropped, and at
    ``from_step`` itself a metric the new attempt logs again replaces the old value."""
    kept: list[dict[str, Any]] = []
    earlier = 0  # kept[:earlier] are the earlier attempts' points
    restart: int | None = None  # the current attempt's from_step
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        if isinstance(entry.get("metrics"), dict):
            entry = _whole_entry(entry)
            if entry is None:
                continue
            if restart is not None and entry.get("step") == restart:
                for old in kept[:earlier]:
                    if old.get("step") == restart:
                        old["metrics"] = {
                            name: value
                            for name, value in old["metrics"].items()
                            if name not in entry["metrics"]
                        }
            kept.append(entry)
        elif isinstance(entry.get("from_step"), int):
            restart = entry["from_step"]
            kept = [old for old in kept if not _step_after(old, restart)]
            earlier = len(kept)
    return [entry for entry in kept if entry["metrics"]]


def _whole_entry(entry: dict[str, Any]) -> dict[str, Any] | None:
    """A metric entry as readers need it (whole-number steps, time and epoch; each value a
    number or None), or None for a damaged one; a damaged value alone is left out."""
    steps = [entry.get(key, 0) for key in ("step", "global_step", "epoch")]
    if not all(isinstance(step, int) and not isinstance(step, bool) for step in steps):
        return None
    if not is_number(entry.get("time", 0.0)):
        return None
    metrics = {
        name: value
        for name, value in entry["metrics"].items()
        if isinstance(name, str) and (value is None or is_number(value))
    }
    return {**entry, "metrics": metrics}


def _step_after(entry: Mapping[str, Any], step: int) -> bool:
    value = entry.get("step")
    return isinstance(value, int | float) and value > step


def replace_json(path: Path, data: Any) -> None:
    """Write a small JSON file so that readers see the old one or the new one, never half."""
    replace_bytes(path, (json.dumps(data, sort_keys=True, default=str) + "\n").encode())


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None  # strict JSON has no NaN


class JournalTracker:
    """Rank 0's tracker: the run's files in its directory, then ``inner`` (MLflow or none).

    ``position`` gives (global step, epoch) when called; ``began_at`` the step this
    attempt's training state began from (0, or the checkpoint's)."""

    def __init__(
        self,
        inner: Tracker,
        run_dir: Path,
        position: Callable[[], tuple[int, int]],
        job_id: str,
        world_size: int,
        tracking: Mapping[str, Any] | None = None,
        began_at: Callable[[], int] = lambda: 0,
    ) -> None:
        self._inner = inner
        self._began_at = began_at
        self._began_said = False
        self._run_dir = run_dir
        self._position = position
        self._failed_write: str | None = None
        try:
            self._previous_text: str | None = (run_dir / STATUS_FILE).read_text()
        except OSError:
            self._previous_text = None
        previous = _parsed(self._previous_text)
        self._status: dict[str, Any] = {
            "state": "running",
            "attempts": int(previous.get("attempts", 0)) + 1,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "job_id": job_id,
            "world_size": world_size,
            "started": previous.get("started", time.time()),
        }
        self._write_status()
        self._tracking = dict(tracking) if tracking is not None else None
        try:
            self._previous_tracking: str | None = (run_dir / TRACKING_FILE).read_text()
        except OSError:
            self._previous_tracking = None
        self._write_tracking()

    def _write_tracking(self) -> None:
        """tracking.json, with the MLflow run's id once the tracker knows it."""
        tracking = self._tracking
        if tracking is not None:
            self._guarded(lambda: replace_json(self._run_dir / TRACKING_FILE, tracking))

    def _note_run_id(self) -> None:
        if self._tracking is not None and self._inner.run_id != self._tracking.get("run_id"):
            self._tracking["run_id"] = self._inner.run_id
            self._write_tracking()

    @property
    def run_id(self) -> str | None:
        return self._inner.run_id

    @property
    def status(self) -> str:
        return self._inner.status

    def _guarded(self, write: Callable[[], None]) -> None:
        try:
            write()
        except OSError as error:
            if self._failed_write is None:
                from hpc_ddp.runtime.logs import get_logger

                get_logger().warning(
                    f"cannot write the run's record in {self._run_dir} ({error}); training "
                    "goes on. HINT: check the file system's space and permissions"
                )
            self._failed_write = str(error)

    def _write_status(self, state: str | None = None) -> None:
        step, epoch = self._position()
        if state is not None:
            self._status["state"] = state
        self._status.update(global_step=step, epoch=epoch, updated=time.time())
        status = dict(self._status)

        def write() -> None:
            make_dirs(self._run_dir)
            replace_json(self._run_dir / STATUS_FILE, status)

        self._guarded(write)

    def restore_previous(self) -> None:
        """Put status.json and tracking.json back as this attempt found them (an attempt
        that did nothing)."""

        def put_back() -> None:
            for name, previous in (
                (STATUS_FILE, self._previous_text),
                (TRACKING_FILE, self._previous_tracking),
            ):
                if previous is None:
                    (self._run_dir / name).unlink(missing_ok=True)
                else:
                    replace_bytes(self._run_dir / name, previous.encode())

        self._guarded(put_back)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        global_step, epoch = self._position()
        entry = {
            "step": step,
            "global_step": global_step,
            "epoch": epoch,
            "time": round(time.time(), 3),
            "metrics": {key: _finite(float(value)) for key, value in metrics.items()},
        }

        lines = [entry]
        if not self._began_said:  # training has begun: the resume is known by now
            self._began_said = True
            began = {"attempt": self._status["attempts"], "from_step": self._began_at()}
            lines.insert(0, {**began, "time": entry["time"]})

        def append() -> None:
            with open_append(self._run_dir / METRICS_FILE) as handle:
                handle.write("".join(json.dumps(line, sort_keys=True) + "\n" for line in lines))

        self._guarded(append)
        self._write_status()
        self._inner.log_metrics(metrics, step)
        self._note_run_id()  # as soon as MLflow named it, for a resume

    def log_json_artifact(self, name: str, data: Any) -> None:
        self._inner.log_json_artifact(name, data)

    def log_text_artifact(self, name: str, text: str) -> None:
        self._inner.log_text_artifact(name, text)

    def finish(self, status: str) -> None:
        self._write_status(END_STATES.get(status, status.lower()))
        self._inner.finish(status)
        self._note_run_id()

    def suspend(self) -> None:
        self._write_status("requeued")
        self._inner.suspend()
        self._note_run_id()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
