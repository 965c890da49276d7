"""Tracking that cannot hurt training: rank 0's MLflow calls run on one background thread,
in order, and the training thread only hands them over. A tracker that cannot start, or fails
later (a server that is down or dies), costs one warning: the run goes on, its metrics stay
in its own record (metrics.jsonl), and the summary says what happened to tracking."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from hpc_ddp.runtime.errors import error_line
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.tracking.base import LoggedMetrics, StoreTracker
from hpc_ddp.runtime.tracking.mlflow_import import export_mlflow_http_settings

#: The longest the training thread waits for MLflow at any one point (the run's id for a
#: checkpoint, the run's end); past it, the run goes on without.
WAIT_LIMIT_S = 30.0
#: At the run's end, the wait goes on past WAIT_LIMIT_S for as long as the tracking process
#: keeps working (a busy machine slows it; one stuck on a server that does not answer uses
#: no CPU): at least this much CPU time in each WAIT_LIMIT_S, and PATIENT_LIMIT_S in all.
WORKING_CPU_S = 0.05
PATIENT_LIMIT_S = 600.0
#: What a tracker fails at when the run stops or ends (no training goes on after it).
ENDINGS = ("ending the run", "suspending the run")
#: How often a tracker that failed is tried again (in the background, never in the way).
RETRY_S = 60.0
#: How long the background thread holds logged metrics for more to send with them: one MLflow
#: call then stores everything logged meanwhile (a loop that logs every step makes about one
#: call a second, not one per step). A stop, an artifact or the run's end sends them at once.
GATHER_S = 1.0


def after_failing(doing: str) -> str:
    """What a warning that MLflow failed ``doing`` says next: what happens now, and the fix."""
    if doing in ENDINGS:
        return (
            "the run's metrics are whole in metrics.jsonl in its directory. HINT: the run's "
            "next attempt sends MLflow what it lacks; for a run that ends here, `hpc-ddp "
            "tracking sync NAME/ID` does, once the server answers"
        )
    return (
        "training goes on without it, and the run's metrics stay in metrics.jsonl in its "
        "directory. HINT: check tracking.uri and that the server is up, or set "
        "tracking.enabled=false"
    )


def wait_for_answer(
    done: threading.Event, window_s: float, cpu_seconds: Callable[[], float | None] | None
) -> str:
    """Wait for ``done``: one ``window_s``, or with ``cpu_seconds`` (the tracking process's
    CPU time; None: unknown) window after window while it grows by WORKING_CPU_S, up to
    PATIENT_LIMIT_S. "" once done, else why the wait ended."""
    waited, used = 0.0, cpu_seconds() if cpu_seconds else None
    while not done.wait(window_s):
        waited, before = waited + window_s, used
        used = cpu_seconds() if cpu_seconds else None
        working = before is not None and used is not None and used - before >= WORKING_CPU_S
        if not working or waited >= PATIENT_LIMIT_S:
            idle = cpu_seconds is not None and used is not None and not working
            return f"no answer within {waited:.0f} s" + (
                " (the tracking process did no work meanwhile)" if idle else ""
            )
    return ""


#: MLflow's answer to a request it refuses for its content (a name, a value), not because
#: the server failed.
REFUSED_CODES = frozenset({"INVALID_PARAMETER_VALUE", "BAD_REQUEST"})


def refused_request(error: BaseException) -> bool:
    return getattr(error, "error_code", None) in REFUSED_CODES


def unreplayed(logged: list[LoggedMetrics], replayed: set[tuple[str, int]]) -> list[LoggedMetrics]:
    """``logged`` less the (metric, step) points a recovery already replayed into MLflow."""
    if not replayed:
        return logged
    kept = []
    for point in logged:
        metrics = {k: v for k, v in point.metrics.items() if (k, point.step) not in replayed}
        if metrics:
            kept.append(point._replace(metrics=metrics))
    return kept


#: A call handed over to the background thread: (what it does, for a warning; method; args).
Call = tuple[str, str, tuple[Any, ...]]


def gather_metrics(
    calls: queue.SimpleQueue[Call], first: LoggedMetrics, gather_s: float
) -> tuple[list[LoggedMetrics], Call | None]:
    """``first`` and the metrics logged after it, until ``gather_s`` passed or another call
    came: returns the metrics and that call (to make next), or None."""
    logged = [first]
    deadline = time.monotonic() + gather_s
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            call = calls.get(timeout=remaining)
        except queue.Empty:
            break
        if call[1] != "log_metrics":
            return logged, call
        logged.append(call[2][0])
    return logged, None


class GuardedTracker:
    """Starts the tracker (creating or reopening the run) on a background thread when first
    used, then makes every call to it on that thread, in order; metrics logged within
    ``gather_s`` of each other go in one call. Nothing here raises into training, and only
    :meth:`finish` and :meth:`suspend` wait: ``wait_limit_s``, and at the end longer while
    ``cpu_seconds`` (the tracking process's CPU time) shows it working."""

    def __init__(
        self,
        start: Callable[[], StoreTracker],
        uri: str,
        wait_limit_s: float = WAIT_LIMIT_S,
        recover: Callable[[], tuple[StoreTracker, set[tuple[str, int]]]] | None = None,
        retry_s: float = RETRY_S,
        gather_s: float = GATHER_S,
        cpu_seconds: Callable[[], float | None] = lambda: None,
    ) -> None:
        self._start = start
        self._cpu_seconds = cpu_seconds
        self._recover = recover
        self._retry_s = retry_s
        self._failed_at: float | None = None
        #: (metric, step) points a recovery replayed: calls queued meanwhile skip them.
        self._replayed: set[tuple[str, int]] = set()
        self._uri = uri
        self._wait_limit_s = wait_limit_s
        self._gather_s = gather_s
        self._calls: queue.SimpleQueue[Call] = queue.SimpleQueue()
        #: A call taken from the queue while gathering metrics, made next.
        self._taken: Call | None = None
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()
        #: The MLflow run once created; still named after MLflow failed (a resume reopens it).
        self._run_id: str | None = None
        self._status = "ok"
        self._dropped: set[str] = set()

    @property
    def status(self) -> str:
        """ "ok", or "failed: <what>: <error>" once MLflow failed and the run went on without."""
        return self._status

    def _ensure_started(self) -> None:
        # Called from the training thread and from the journal's writer (metrics handed on).
        with self._starting:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._work, name="hpc-ddp-tracker", daemon=True
                )
                self._thread.start()

    def _work(self) -> None:
        tracker: StoreTracker | None = None
        try:
            export_mlflow_http_settings()
            tracker = self._start()
            self._run_id = tracker.run_id
        except BaseException as error:
            self._fail("could not start", error)
        while True:
            doing, method, args = self._next_call()
            if tracker is None and method not in ("finish", "suspend", "_done"):
                tracker = self._retry()  # never at a stop or the end: they must not wait
            done = args[-1] if method == "_done" else None
            if done is not None:
                done.set()
                continue
            if tracker is None or method == "_idle":
                continue
            if method == "log_metrics":
                logged, self._taken = gather_metrics(self._calls, args[0], self._gather_s)
                method, args = "log_metric_steps", (unreplayed(logged, self._replayed),)
                if not args[0]:
                    continue
            try:
                getattr(tracker, method)(*args)
            except BaseException as error:
                if refused_request(error):  # this call's content, not the server: go on
                    self._drop(doing, error)
                    continue
                self._fail(doing, error)
                tracker = None

    def _next_call(self) -> Call:
        if self._taken is not None:
            call, self._taken = self._taken, None
            return call
        try:
            return self._calls.get(timeout=self._retry_s)
        except queue.Empty:
            return "", "_idle", ()

    def _retry(self) -> StoreTracker | None:
        """The tracker again, after replaying the run's record, once RETRY_S passed since
        it failed; None while MLflow stays away."""
        if self._recover is None or self._failed_at is None:
            return None
        if time.monotonic() - self._failed_at < self._retry_s:
            return None
        try:
            tracker, self._replayed = self._recover()
        except BaseException as error:
            self._failed_at = time.monotonic()
            get_logger().debug(f"MLflow at {self._uri} still fails: {error_line(error)}")
            return None
        self._run_id = tracker.run_id
        self._status = f"recovered after: {self._status.removeprefix('failed: ')}"
        self._failed_at = None
        get_logger().warning(
            f"MLflow at {self._uri} answers again: the run's record was replayed into run "
            f"{tracker.run_id} and tracking goes on"
        )
        return tracker

    def _drop(self, doing: str, error: BaseException) -> None:
        """One warning per kind of refused call; tracking goes on with the next."""
        if doing not in self._dropped:
            self._dropped.add(doing)
            get_logger().warning(
                f"MLflow at {self._uri} refused {doing} ({error_line(error)}); that call is "
                "dropped, tracking goes on, and metrics.jsonl keeps every point"
            )

    def _fail(self, doing: str, error: BaseException) -> None:
        self._failed_at = time.monotonic()
        if self._status.startswith("failed"):
            return
        self._status = f"failed: {doing}: {error_line(error)}"
        get_logger().warning(
            f"MLflow at {self._uri} failed {doing} ({error_line(error)}); {after_failing(doing)}"
        )

    def _submit(self, doing: str, method: str, *args: Any) -> None:
        self._ensure_started()
        self._calls.put((doing, method, args))

    def _wait(self, what: str, patient: bool = False) -> bool:
        """Wait (bounded) until every call handed over so far is done: ``wait_limit_s``, or
        where ``patient`` as long as the tracking process keeps working (WORKING_CPU_S in
        each ``wait_limit_s``, PATIENT_LIMIT_S in all)."""
        done = threading.Event()
        self._submit("", "_done", done)
        unanswered = wait_for_answer(
            done, self._wait_limit_s, self._cpu_seconds if patient else None
        )
        if unanswered:
            self._fail(what, TimeoutError(unanswered))
        return not unanswered

    @property
    def run_id(self) -> str | None:
        """The MLflow run's id once it exists; None while MLflow is still starting (never
        waited for: a checkpoint without it resumes the run named in tracking.json)."""
        self._ensure_started()
        return self._run_id

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        logged = LoggedMetrics(dict(metrics), step, int(time.time() * 1000))
        self._submit("logging metrics", "log_metrics", logged)

    def log_json_artifact(self, name: str, data: Any) -> None:
        self._submit(f"storing {name}", "log_json_artifact", name, data)

    def log_text_artifact(self, name: str, text: str) -> None:
        self._submit(f"storing {name}", "log_text_artifact", name, text)

    def set_tag(self, key: str, value: str) -> None:
        self._submit(f"tagging the run {key}", "set_tag", key, value)

    def finish(self, status: str) -> None:
        # The run ends now, not when the background thread and MLflow get to it.
        self._submit("ending the run", "finish", status, int(time.time() * 1000))
        # A finished run has no deadline to keep: a stop has the job's warning time, and a
        # failure's report and the other ranks are waiting.
        self._wait("ending the run", patient=status == "FINISHED")

    def suspend(self) -> None:
        # Before a requeue, within the job's warning time: never past wait_limit_s.
        self._submit("suspending the run", "suspend")
        self._wait("suspending the run")
