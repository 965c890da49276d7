"""Rank 0's MLflow client in a process of its own.

mlflow's import (about 2 s of CPU), the store's schema check and every call after them run in
a child process, so none of it holds the training process's GIL: in a thread of rank 0 they
stalled rank 0's steps, and every other rank waited for rank 0 in the next all-reduce. It
starts at the rank's own CPU priority: at nice 10 from the start, on cores busy with other
work it got so little that a short run ended before its MLflow run existed (45 s against
13 s at nice 0). Once the MLflow run exists it steps down to :data:`STEADY_NICE`: what is
left is a call a second at most (a few ms of CPU each), which then takes the cores' idle
moments before training's time, where the ranks keep every core busy. The
parent side (:class:`WorkerTracker`) is a Tracker whose calls block until the child answered;
GuardedTracker makes them on its background thread.

The child ignores the job's signals (Slurm signals every process of a step): it ends when
the parent says so, or when the parent is gone (without ending the MLflow run, as a rank
killed outright would leave it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_ddp.runtime.exits import rank_label
from hpc_ddp.runtime.tracking.mlflow_import import import_mlflow, let_in, mlflow_http_settings

if TYPE_CHECKING:
    from hpc_ddp.runtime.tracking.base import LoggedMetrics, RunRecord

#: Stop and warning signals a job step receives; the parent handles them, the child must not
#: die of them.
JOB_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGURG")
)


@dataclass
class Worker:
    """A started child process and the parent's end of its pipe."""

    process: subprocess.Popen[bytes]
    connection: Connection


def cpu_seconds(pid: int, proc: Path = Path("/proc")) -> float | None:
    """The CPU time process ``pid`` has used (Linux's /proc); None where it cannot be read."""
    try:
        fields = (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def spawn_worker(environ: Mapping[str, str] | None = None) -> Worker:
    """Start the child now, in ``environ`` (default: this process's) with MLflow's HTTP
    retries cut short unless it sets them (MLflow reads them from its environment only). It
    imports mlflow and the store's module at once, and touches no MLflow run until it is
    asked to (a run that ends with nothing to track leaves MLflow as it was; the child
    leaves when the parent does)."""
    base = os.environ if environ is None else environ
    ours, theirs = Pipe()
    # Blocked here, the job's signals stay blocked in the child until it ignores them: one
    # that arrives between the fork and that moment cannot end it.
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "hpc_ddp.runtime.tracking.worker", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env={**base, **mlflow_http_settings(base)},
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        theirs.close()
    return Worker(process, ours)


#: The worker :func:`prestart` started, until :func:`take_prestarted` hands it over.
_prestarted: list[Worker] = []
#: The setting that turns tracking off, as a command line or HPC_DDP_OVERRIDES writes it.
TRACKING_OFF = "tracking.enabled=false"


def probably_rank_0(environ: Mapping[str, str]) -> bool:
    """Whether the launcher made this process rank 0, before anything is resolved."""
    return rank_label(environ) == "0"


def prestart(environ: Mapping[str, str], argv: Sequence[str]) -> bool:
    """At a rank's first line, start rank 0's tracking process: mlflow's import (about 3 s of
    CPU) then runs while the rank imports torch, not after it, where a short run would wait
    for it at its end. Not on the other ranks, nor when the command line or
    HPC_DDP_OVERRIDES turns tracking off. hpc_ddp.start takes the process over, or ends it
    when the run does not track; it touches no MLflow run before that."""
    settings = [*argv, *environ.get("HPC_DDP_OVERRIDES", "").split()]
    if not probably_rank_0(environ) or TRACKING_OFF in settings:
        return False
    _prestarted.append(spawn_worker(environ))
    return True


def take_prestarted() -> Worker | None:
    """The worker :func:`prestart` started, once; None if it started none."""
    return _prestarted.pop() if _prestarted else None


def discard_prestarted() -> None:
    """End a prestarted worker that no run will use (it has touched no MLflow run)."""
    while _prestarted:
        worker = _prestarted.pop()
        worker.connection.close()
        worker.process.kill()
        worker.process.wait()


class WorkerTracker:
    """An MLflow run driven from a child process (see the module docstring): created, or
    reopened, when this is made. ``catch_up``: the run directory whose earlier attempts'
    points the child then sends to the run where MLflow lacks them (``behind``: the last
    attempt's tracking did not end whole), best effort."""

    status = "ok"

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        artifact_root: Path,
        record: RunRecord,
        log_prefix: tuple[int, int] = (0, 1),
        worker: Worker | None = None,
        catch_up: Path | None = None,
        behind: bool = False,
    ) -> None:
        worker = worker or spawn_worker()
        self._process, self._connection = worker.process, worker.connection
        self.run_id: str | None = self._call(
            "start",
            tracking_uri,
            experiment,
            str(artifact_root),
            record,
            log_prefix,
        )
        if catch_up is not None:
            self._catch_up(catch_up, behind)

    def _catch_up(self, run_dir: Path, behind: bool) -> None:
        """Best effort: MLflow tracks on without the earlier attempts' points, which a sync
        after the run sends."""
        try:
            self._call("catch_up", str(run_dir), behind)
        except RuntimeError as error:
            from hpc_ddp.runtime.logs import get_logger

            get_logger().warning(
                f"MLflow did not take the points earlier attempts left out of it ({error}); "
                f"they are in {run_dir}/metrics.jsonl. HINT: `hpc-ddp tracking sync "
                f"{run_dir}` sends them once the run ended"
            )

    def _call(self, method: str, *args: Any) -> Any:
        try:
            self._connection.send((method, args))
            outcome, value = self._connection.recv()
        except (EOFError, OSError):
            code = self._process.wait()
            raise RuntimeError(f"the tracking process ended (exit status {code})") from None
        if outcome == "error":
            raise RuntimeError(value)
        return value

    def _end(self) -> None:
        self._connection.close()
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._call("log_metrics", dict(metrics), step)

    def log_metric_steps(self, logged: Sequence[LoggedMetrics]) -> None:
        self._call("log_metric_steps", list(logged))

    def log_json_artifact(self, name: str, data: Any) -> None:
        self._call("log_json_artifact", name, data)

    def log_text_artifact(self, name: str, text: str) -> None:
        self._call("log_text_artifact", name, text)

    def set_tag(self, key: str, value: str) -> None:
        self._call("set_tag", key, value)

    def finish(self, status: str, end_time_ms: int | None = None) -> None:
        try:
            self._call("finish", status, end_time_ms)
        finally:
            self._end()

    def suspend(self) -> None:
        # Not the end: a requeue that fails is followed by finish("KILLED"). After a requeue
        # the parent exits, and the child, seeing it gone, leaves the run RUNNING.
        self._call("suspend")


def _start(
    uri: str,
    experiment: str,
    artifacts: str,
    record: RunRecord,
    log_prefix: tuple[int, int],
) -> Any:
    from hpc_ddp.runtime.logs import setup_logging
    from hpc_ddp.runtime.tracking.mlflow_tracker import open_mlflow_run

    setup_logging(*log_prefix)
    return open_mlflow_run(uri, experiment, Path(artifacts), record)


#: The tracking process's niceness above the rank's once its MLflow run exists.
STEADY_NICE = 10


def step_down() -> None:
    """Lower this process's CPU priority by :data:`STEADY_NICE` (a process may always lower
    its own; a system that refuses leaves it as it was)."""
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: no os.nice here
        os.nice(STEADY_NICE)


def answer_call(tracker: Any, method: str, args: tuple[Any, ...]) -> tuple[Any, Any]:
    """The tracker after the parent's call, and the call's value. A call that wants a
    package this process left out (mlflow_import) is made again with it; "start" is not,
    as it may have created the MLflow run (a failed start is retried by GuardedTracker)."""
    if method == "start":
        tracker = _start(*args)
        return tracker, tracker.run_id
    try:
        return tracker, getattr(tracker, method)(*args)
    except ImportError:
        if not let_in():
            raise
        return tracker, getattr(tracker, method)(*args)


def serve(connection: Connection) -> int:
    """Answer the parent's calls until it ends the run or goes away (then the MLflow run is
    left as it is)."""
    tracker: Any = None
    while True:
        try:
            method, args = connection.recv()
        except (EOFError, OSError):
            return 0
        started = tracker is not None
        try:
            tracker, value = answer_call(tracker, method, args)
            answer: tuple[str, Any] = ("ok", value)
        except Exception as error:
            lines = str(error).strip().splitlines()
            answer = ("error", f"{type(error).__name__}: {lines[0] if lines else ''}")
        try:
            connection.send(answer)
        except OSError:
            return 0
        if not started and tracker is not None:
            step_down()
        if method == "finish":
            # Every call was synchronous, so all is stored: skip mlflow's exit hooks (about
            # a second of interpreter teardown) that the parent would otherwise wait for.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def _leave_with(parent: int) -> None:
    """Exit as soon as the parent is gone, even in the middle of a call (MLflow retrying a
    server that is down): the child must not hold the rank's output open after it."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def main(argv: list[str]) -> int:
    threading.Thread(target=_leave_with, args=(os.getppid(),), daemon=True).start()
    for number in JOB_SIGNALS:
        signal.signal(number, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, JOB_SIGNALS)
    connection = Connection(int(argv[0]))
    import_mlflow()  # the slow part of starting, done while the parent starts its run
    return serve(connection)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
