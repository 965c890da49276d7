"""Rank 0 writes the run's own record (:mod:`hpc_ddp.runtime.tracking.record` says what it
holds), then hands each call on to MLflow or to nothing. Writing is best effort: a full disk
or a lost mount costs the record, never the training. The files are written off the
training thread (:mod:`hpc_ddp.runtime.tracking.background`): a slow shared file system
delays the record, not the next step of every rank.
"""

from __future__ import annotations

import copy
import json
import math
import os
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.safefiles import make_dirs, open_append, replace_bytes
from hpc_ddp.runtime.tracking.background import BackgroundWrites
from hpc_ddp.runtime.tracking.base import Tracker
from hpc_ddp.runtime.tracking.record import (
    METRICS_FILE,
    STATUS_FILE,
    TAGS_SET,
    TRACKING_FILE,
    TRACKING_OUTCOME,
    parsed_object,
    replace_json,
    tags_set,
)

#: The longest the training thread waits for the record's files to be written, where it
#: waits at all (the attempt's start and end); past it, the run goes on and says so.
SETTLE_LIMIT_S = 30.0

#: What a tracker's final status means for the run.
END_STATES = {"FINISHED": "finished", "FAILED": "failed", "KILLED": "stopped"}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None  # strict JSON has no NaN


def text_or_none(path: Path) -> str | None:
    """The file's text; None where it cannot be read (none yet)."""
    try:
        return path.read_text()
    except OSError:
        return None


def attempt_status(previous: Mapping[str, Any], job_id: str, world_size: int) -> dict[str, Any]:
    """status.json of an attempt starting now in this process, after ``previous`` (the
    run's status.json as found; {} for a new run)."""
    return {
        "state": "running",
        "attempts": int(previous.get("attempts", 0)) + 1,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "job_id": job_id,
        "world_size": world_size,
        "started": previous.get("started", time.time()),
    }


class JournalTracker:
    """Rank 0's tracker: the run's files in its directory, then ``inner`` (MLflow or none).

    ``position`` gives (global step, epoch) when called; ``began_at`` the step this
    attempt's training state began from (0, or the checkpoint's). A log interval's writes,
    and then its call to ``inner``, are handed to a background thread; the attempt's start,
    end and suspension wait for every one before them (at most ``settle_limit_s``)."""

    def __init__(
        self,
        inner: Tracker,
        run_dir: Path,
        position: Callable[[], tuple[int, int]],
        job_id: str,
        world_size: int,
        tracking: Mapping[str, Any] | None = None,
        began_at: Callable[[], int] = lambda: 0,
        settle_limit_s: float = SETTLE_LIMIT_S,
    ) -> None:
        self._inner = inner
        self._writes = BackgroundWrites()
        self._settle_limit_s = settle_limit_s
        self._late_said = False
        self._inner_ended = False
        self._began_at = began_at
        self._began_said = False
        self._run_dir = run_dir
        self._position = position
        self._failed_write: str | None = None
        self._previous_text = text_or_none(run_dir / STATUS_FILE)
        self._status = attempt_status(parsed_object(self._previous_text), job_id, world_size)
        self._write_status()
        self._previous_tracking = text_or_none(run_dir / TRACKING_FILE)
        # The tags earlier attempts set are kept for a sync (the opening sends them with the
        # run's own tags: one may have been set while MLflow was away).
        earlier_tags = tags_set(parsed_object(self._previous_tracking))
        self._tracking = dict(tracking) if tracking is not None else None
        if self._tracking is not None and earlier_tags:
            self._tracking[TAGS_SET] = {**earlier_tags, **tags_set(self._tracking)}
        self._write_tracking()
        self.flush()

    def _write_tracking(self) -> None:
        """tracking.json, with the MLflow run's id once the tracker knows it."""
        tracking = dict(self._tracking) if self._tracking is not None else None
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
        """Hand ``write`` to the background thread, which says its first error once."""

        def attempt() -> None:
            try:
                write()
            except OSError as error:
                if self._failed_write is None:
                    get_logger().warning(
                        f"cannot write the run's record in {self._run_dir} ({error}); "
                        "training goes on. HINT: check the file system's space and permissions"
                    )
                self._failed_write = str(error)

        self._writes.submit(attempt)

    def flush(self) -> bool:
        """Wait, at most ``settle_limit_s``, until everything handed over so far is written
        (and handed on); whether it was. Past the limit, one warning."""
        if self._writes.drain(self._settle_limit_s):
            return True
        self._say_late()
        return False

    def _say_late(self) -> None:
        if self._late_said:
            return
        self._late_said = True
        get_logger().warning(
            f"the run's record in {self._run_dir} was not written within "
            f"{self._settle_limit_s:.0f} s; the run goes on without waiting for it. HINT: the "
            "file system there does not answer; check the mount (df, dmesg)"
        )

    def _hand_on(self, call: Callable[[], None]) -> None:
        """``call`` to the inner tracker, after the writes before it; none once the inner
        tracker's run ended while they waited."""

        def after_writes() -> None:
            if not self._inner_ended:
                call()

        self._writes.submit(after_writes)

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
        self.flush()

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

        # Made here: a value JSON cannot hold fails in the caller's frame, not in the writer.
        text = "".join(json.dumps(line, sort_keys=True) + "\n" for line in lines)

        def append() -> None:
            with open_append(self._run_dir / METRICS_FILE) as handle:
                handle.write(text)

        self._guarded(append)
        self._write_status()
        # After the line is written: MLflow, recovering from an outage, replays the file and
        # then sends only the points it did not find there.
        handed_on = dict(metrics)
        self._hand_on(lambda: self._inner.log_metrics(handed_on, step))
        self._note_run_id()  # as soon as MLflow named it, for a resume
        if self._writes.waiting_s() > self._settle_limit_s:
            self._say_late()

    def log_json_artifact(self, name: str, data: Any) -> None:
        kept = copy.deepcopy(data)  # as it is now: the caller may change it before it is sent
        self._hand_on(lambda: self._inner.log_json_artifact(name, kept))

    def log_text_artifact(self, name: str, text: str) -> None:
        self._hand_on(lambda: self._inner.log_text_artifact(name, text))

    def set_tag(self, key: str, value: str) -> None:
        """Kept in tracking.json too: a recovery from an outage or `hpc-ddp tracking sync`
        sends it again, and so does the next attempt."""
        if self._tracking is not None:
            self._tracking[TAGS_SET] = {**tags_set(self._tracking), key: value}
            self._write_tracking()
        self._hand_on(lambda: self._inner.set_tag(key, value))

    def finish(self, status: str) -> None:
        self._write_status(END_STATES.get(status, status.lower()))
        self._end_inner(lambda: self._inner.finish(status))

    def suspend(self) -> None:
        self._write_status("requeued")
        self._end_inner(self._inner.suspend)

    def _end_inner(self, end: Callable[[], None]) -> None:
        """End the inner tracker's run once what was handed on reached it; when the files
        do not get written in time, at once, and what still waits is not sent after it."""
        written = not self._inner_ended and self.flush()  # once late, an end waits no more
        self._inner_ended = not written
        end()
        self._note_run_id()
        # The next attempt replays what this one left out of MLflow (record.mlflow_behind).
        outcome = self._inner.status if written else "behind: its record was written late"
        self._status[TRACKING_OUTCOME] = outcome
        self._write_status()
        if written:
            self.flush()
