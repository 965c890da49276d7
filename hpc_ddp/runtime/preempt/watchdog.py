"""The stall watchdog: a rank whose training makes no progress says where it is stuck and
ends the job, instead of waiting out the collective timeout with no clue.

While :meth:`hpc_ddp.Run.steps` hands out batches, every micro-batch is a heartbeat. When
none comes for ``dist.stall_timeout_s`` (the first one after start is allowed
``dist.timeout_s``: it includes compilation and warm-up), the rank writes every thread's
Python stack to its log (faulthandler), one line naming the rank, the step and what its main
thread is doing, ends its run (MLflow FAILED) and exits with :data:`EXIT_STALLED`; the
launcher then ends the other ranks. A rank whose main thread only waits inside torch (for the
other ranks, or its device) exits with :data:`EXIT_PEER_LOST` instead, a consequence: the
ranks stall at the same moment, and the launcher names the one stuck in the user's code or a
DataLoader worker, whichever exits first. Evaluation between epochs and checkpoint writes are not
watched: they are bounded by ``dist.timeout_s``. Time in which the process itself did not run
(stopped by SIGSTOP or ``scontrol suspend``, or on a host that hung) is not a stall: a job
resumed after a suspension goes on, and a rank frozen while the others went on finds their
end in its next collective (a lost peer, as the others' reports name it).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping

from hpc_ddp.runtime.errors import EXIT_PEER_LOST, EXIT_STALLED
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.preempt.liveness import Liveness, ProcessStops
from hpc_ddp.runtime.preempt.stall_report import (
    stall_exit_code,
    stall_failure,
    stuck_in,
    stuck_words,
    write_stall_report,
)
from hpc_ddp.runtime.turns import OutputTurns

#: Seconds between the watchdog's looks at the heartbeat.
CHECK_PERIOD_S = 0.5
#: Seconds the run's end (MLflow FAILED, status.json) may take before the rank exits anyway.
ENDING_GRACE_S = 15.0


class StallWatchdog:
    """Ends this rank when :meth:`beat` is not called for ``timeout_s`` while armed (see the
    module docstring). ``where``: the run's position in words; ``end_run(failure)``: ends the
    run (MLflow FAILED) before the rank exits, what ended it (:func:`stall_failure`) on
    record; ``output``: the turns this rank takes with others
    to write (its stacks go out whole). :meth:`start` begins the watch."""

    def __init__(
        self,
        timeout_s: float,
        first_timeout_s: float,
        rank: int,
        where: Callable[[], str],
        end_run: Callable[[Mapping[str, object]], None],
        liveness: Liveness | None = None,
        clock: Callable[[], float] = time.monotonic,
        output: OutputTurns | None = None,
        stops: ProcessStops | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self._output = output or OutputTurns(None)
        self._liveness = liveness
        self._clock = clock
        self.first_timeout_s = max(timeout_s, first_timeout_s)
        self.rank = rank
        self._where = where
        self._end_run = end_run
        self._main = threading.main_thread()
        #: The time this process did not run, as this watchdog's looks find it.
        self.stops = stops or ProcessStops(CHECK_PERIOD_S, clock)
        #: When the last beat came, and the stops' total then (later stops do not count
        #: towards the wait): one tuple, so the watchdog's thread never reads half of a beat.
        self._beat = (clock(), 0.0)
        self._said_stopped = False
        self._allowed = self.first_timeout_s
        self.armed = False
        self._resting = False
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hpc_ddp-watchdog", daemon=True)

    def start(self) -> StallWatchdog:
        """Look at the heartbeat every CHECK_PERIOD_S from now on, on a thread of its own."""
        self._thread.start()
        return self

    def arm(self) -> None:
        """Watch from now on (a training loop begins or goes on)."""
        now = self._clock()
        self._beat = (now, self.stops.total_at(now))
        self.armed = True
        if self._liveness is not None:
            self._liveness.entered_loop()

    def beat(self) -> None:
        """A micro-batch finished: training makes progress (a watch at rest goes on)."""
        now = self._clock()
        self._beat = (now, self.stops.total_at(now))
        self._allowed = self.timeout_s
        if self._resting:
            self._resting = False
            self.armed = True

    def rest(self) -> None:
        """Stop watching until the next :meth:`beat`: the user's own code runs between
        steps (an evaluation may take longer than a step may)."""
        if self.armed:
            self.armed = False
            self._resting = True

    def disarm(self, left_loop: str | None = None) -> None:
        """Stop watching (the loop ended, or a checkpoint is being written). ``left_loop``:
        why this rank left the training loop before its steps were done, for the others'
        stall reports."""
        self.armed = False
        self._resting = False
        if left_loop is not None and self._liveness is not None:
            self._liveness.left_loop(left_loop)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No watch inside (a checkpoint being written); watched again after, if it was."""
        if not self.armed:
            yield
            return
        self.disarm()
        try:
            yield
        finally:
            self.arm()

    def close(self) -> None:
        self.armed = False
        self._closed.set()
        if self._liveness is not None:
            self._liveness.close()

    def overdue(self, now: float | None = None) -> float | None:
        """Seconds without a heartbeat at ``now`` (the clock's time by default), once past
        what is allowed while armed; else None. Time the process did not run, as
        :meth:`check` found it, does not count."""
        now = self._clock() if now is None else now
        last, stopped_then = self._beat
        waited = now - last - (self.stops.total_at(now) - stopped_then)
        return waited if self.armed and waited > self._allowed else None

    def check(self) -> float | None:
        """One look at the heartbeat (:meth:`overdue`), made every CHECK_PERIOD_S; time in
        which the process did not run (:class:`ProcessStops`) does not count, and an armed
        watch says so (once: gang scheduling suspends a job every time slice)."""
        now = self._clock()  # one time for both: a stop between two reads would count
        stopped = self.stops.look(now)
        if stopped and self.armed and not self._said_stopped:
            self._said_stopped = True
            get_logger().warning(
                f"rank {self.rank} did not run for {stopped:.0f} s (its process was stopped: "
                "SIGSTOP, a suspended job, or a host that hung); that time does not count "
                "towards dist.stall_timeout_s (said once: later stops count the same way)"
            )
        return self.overdue(now)

    def _watch(self) -> None:
        self.stops.look()  # the thread's first look: no time between it and the start counts
        try:
            while not self._closed.wait(CHECK_PERIOD_S):
                waited = self.check()
                if waited is not None:
                    self._fire(waited)
                    return
        finally:  # by this thread alone: no look of its own comes after
            self.stops.stop_looking()

    def _fire(self, waited: float) -> None:
        failure: Mapping[str, object] = {}
        try:
            failure = self.report_stall(waited)
            ending = threading.Thread(target=self._end_run, args=(failure,), daemon=True)
            ending.start()
            ending.join(ENDING_GRACE_S)
            # A hung DataLoader worker would outlive the rank (holding its output open).
            for child in multiprocessing.active_children():
                child.kill()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:  # whatever failed in the report, the stalled rank ends
            os._exit(EXIT_PEER_LOST if failure.get("follows_another_rank") else EXIT_STALLED)

    def report_stall(self, waited: float) -> dict[str, object]:
        """Write the stall's report (:func:`write_stall_report`); return what ended this rank
        for the run's record (:func:`stall_failure`)."""
        kind, at = stuck_in(sys._current_frames().get(self._main.ident or -1))
        stuck = stuck_words(kind, at)
        others = self._liveness.silent_ranks() if self._liveness is not None else ""
        stalled = (
            f"no training step finished for {waited:.0f} s (dist.stall_timeout_s="
            f"{self.timeout_s:g})"
        )
        write_stall_report(self.rank, f"{stalled} at {self._where()}", stuck, others, self._output)
        follows = stall_exit_code(kind, self._liveness is not None) == EXIT_PEER_LOST
        return stall_failure(f"{stalled}, {kind}", at, others, follows)
