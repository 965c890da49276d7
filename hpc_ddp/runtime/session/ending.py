"""How a run ends on this rank, whichever way: finish, an agreed stop, an exception nobody
caught, or the interpreter exiting. MLflow gets the true final status once, the signal
handlers are given back and, on a clean end, the process groups are taken down."""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

from hpc_ddp.runtime.errors import EXIT_FAILURE
from hpc_ddp.runtime.exits import (
    failure_record,
    leave,
    process_group_alive,
    rank_label,
    report_failure,
    toolkit_frame,
)
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.loop.position import Position
from hpc_ddp.runtime.monitor.account import goodput_metrics
from hpc_ddp.runtime.place.dist import shutdown_distributed
from hpc_ddp.runtime.preempt.signals import StopSignals
from hpc_ddp.runtime.tracking.base import Tracker

#: How long a run's end leaves the GIL to the process groups' worker threads (see Ending).
WORKER_RELEASE_S = 0.05


class Ending:
    """Ends a run once, whichever way it ends: finish, stop, an exception or exit."""

    def __init__(
        self,
        signals: StopSignals,
        label: str,
        tracker: Tracker,
        close_loop: Callable[[bool], None],
        position: Position,
        record_end: Callable[[str | None, int, int], Mapping[str, Any] | None],
        record_failure: Callable[[Mapping[str, Any], int], None],
    ) -> None:
        """``close_loop(wait)``: the loop's displays and stop agreement ended (waiting for
        the agreement in flight only on a clean end); ``position``: the run's;
        ``record_end(status, last step, first step)``: the attempt's end put on record,
        returning the run's time account (None where this rank keeps no record);
        ``record_failure(failure, step)``: what ended this rank, added to the run's
        failures."""
        self.signals = signals
        self.label = label
        self.tracker = tracker
        self.close_loop = close_loop
        self.position = position
        self.record_end = record_end
        self.record_failure = record_failure
        #: The run's time account over its attempts, once this one has ended (rank 0).
        self.account: Mapping[str, Any] | None = None
        self.done = False

    def __call__(self, status: str | None) -> None:
        if self.done:
            return
        self.done = True
        clean = status in (None, "FINISHED")
        try:
            self.close_loop(clean)
            self.account = self._recorded(status)
            if status is not None:
                if self.account is not None:
                    self.tracker.log_metrics(
                        goodput_metrics(self.account), self.position.global_step
                    )
                self.tracker.finish(status)
            # Training froze every object alive at its start (gc.freeze): let the collector
            # free them now, while the process group and torch are whole, not at exit.
            gc.unfreeze()
        finally:
            self.signals.restore()
            if _ACTIVE and _ACTIVE[-1] is self:
                _ACTIVE.pop()
            if clean:  # after a failure a peer may be gone: tearing down could hang
                shutdown_distributed()
                # gloo's worker threads free a finished collective's tensors after its wait()
                # returned, and need the GIL for that: give it to them now, or they may ask for
                # it while the interpreter finalizes, which aborts the process.
                time.sleep(WORKER_RELEASE_S)

    def fail(self, error: BaseException) -> None:
        """End the run after ``error`` ended the script (Ctrl-C: KILLED, not a failure),
        what ended it on record first."""
        if isinstance(error, KeyboardInterrupt):
            self("KILLED")
            return
        if not self.done:
            self.record_failure(failure_record(error), self.position.global_step)
        self("FAILED")

    def _recorded(self, status: str | None) -> Mapping[str, Any] | None:
        """The attempt's end on record; the run's account, or None. A record that cannot be
        kept costs one warning, never the end itself."""
        position = self.position
        try:
            return self.record_end(status, position.global_step, position.resumed_from_step or 0)
        except Exception as error:  # a damaged attempts.json: the run still ends whole
            get_logger().warning(
                f"the attempt's time account was not recorded ({type(error).__name__}: {error})"
                ". HINT: attempts.json in the run directory may be damaged; remove it"
            )
            return None


_ACTIVE: list[Ending] = []
_previous_hook = sys.excepthook
# A child the user's code forks (a worker, a helper) does not hold the run: its exit must not
# end it, nor mark it FAILED in MLflow.
os.register_at_fork(after_in_child=_ACTIVE.clear)


def end_active_run(error: BaseException) -> None:
    """End the run this process holds, if any, after ``error`` ended the script: MLflow
    FAILED (KILLED for Ctrl-C), signal handlers restored but for the job's stop signals,
    ignored from now on: the process is leaving, and a stop sent to the job meanwhile (the
    launcher ending the other ranks) must not cut its report and exit handlers short."""
    if _ACTIVE:
        ending = _ACTIVE[-1]
        ending.fail(error)
        ending.signals.ignore_from_now_on()


def _excepthook(
    kind: type[BaseException], error: BaseException, trace: TracebackType | None
) -> None:
    """An exception nobody caught: end the run (MLflow FAILED), then say why on one line
    with the documented exit code, or show the traceback (exit 1)."""
    label = _ACTIVE[-1].label if _ACTIVE else rank_label(os.environ)
    end_active_run(error)
    if not isinstance(error, Exception | KeyboardInterrupt):
        _previous_hook(kind, error, trace)
        return
    code = report_failure(error, label, toolkit_frame)
    if code != EXIT_FAILURE or process_group_alive():
        leave(code)  # see exit_process


@atexit.register
def _at_exit() -> None:
    """A script that ended without run.finish() (or exited on its own) still ends its run."""
    while _ACTIVE:
        ending = _ACTIVE[-1]
        completed = ending.position.completed
        if ending.label == "0":  # every rank runs the same script: said once
            get_logger().warning(
                "the script ended without run.finish(): no final checkpoint or summary.json. "
                "HINT: call run.finish() after training"
            )
        ending("FINISHED" if completed else "FAILED")


def install_excepthook() -> None:
    """Errors nobody catches get hpc_ddp's one-line reports and exit codes, also those raised
    while :func:`hpc_ddp.start` is still checking the launch."""
    sys.excepthook = _excepthook


def watch(ending: Ending) -> None:
    """Make ``ending`` the run this process holds: an uncaught exception or the interpreter
    exiting ends it."""
    _ACTIVE.append(ending)
    sys.excepthook = _excepthook
