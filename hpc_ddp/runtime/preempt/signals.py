"""Stop signals: recorded by the handler, agreed by all ranks at a step boundary.

The signal handler only records the signal. At step boundaries the ranks agree through one
tiny all-reduce on a CPU (gloo) group, overlapped with the next step, so every rank stops
after the SAME step; then they checkpoint together (see :mod:`hpc_ddp.runtime.loop.steps`).
"""

from __future__ import annotations

import signal
import sys
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.preempt.exit_signals import ignore_until_exit, ignored_after_the_run
from hpc_ddp.runtime.preempt.startup_signals import release_stop_signals

__all__ = ["StepAgreement", "StopSignals", "ignored_after_the_run"]


class StopSignals:
    """Records stop signals; nothing else happens inside the handler."""

    def __init__(
        self, warning_signal: str, stop_on_sigterm: bool = True, announce: bool = False
    ) -> None:
        self.warning = signal.Signals[f"SIG{warning_signal}"]
        self.stop_on_sigterm = stop_on_sigterm
        #: Say on stderr what a Ctrl-C does (rank 0).
        self.announce = announce
        self.received: set[int] = set()
        self._previous: dict[int, Any] = {}

    def _record(self, signum: int, _frame: FrameType | None) -> None:
        self.received.add(signum)

    def _interrupt(self, signum: int, _frame: FrameType | None) -> None:
        """Ctrl-C: the first is a stop like SIGTERM (all ranks stop after the same step, with
        a checkpoint); a second one aborts at once, as Python's own handler does."""
        if signum in self.received:
            raise KeyboardInterrupt
        self.received.add(signum)
        if self.announce:
            sys.stderr.write(
                "\nCtrl-C: stopping with a checkpoint at the ranks' next agreed check (about a "
                "second of training; preempt.check_every_steps); press Ctrl-C again to abort "
                "without one\n"
            )

    def _ignore(self, _signum: int, _frame: FrameType | None) -> None:
        pass

    def install(self) -> StopSignals:
        """Handle the stop signals from now on, including any held during start-up.

        A held signal is raised again once the handlers are in place, so it meets exactly the
        handling it would have met arriving now: recorded, ignored, or (not a stop signal
        here) its default action."""
        arrived_during_startup = release_stop_signals()
        self._previous[self.warning] = signal.signal(self.warning, self._record)
        if self.warning != signal.SIGTERM:
            term_handler = self._record if self.stop_on_sigterm else self._ignore
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, term_handler)
        interrupt_is_pythons = signal.getsignal(signal.SIGINT) is signal.default_int_handler
        if self.warning != signal.SIGINT and interrupt_is_pythons:  # not a handler of yours
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)
        for signum in arrived_during_startup:
            get_logger().warning(
                f"{signal.Signals(signum).name} arrived while this rank was starting; "
                "handling it now"
            )
            signal.raise_signal(signum)
        return self

    def restore(self) -> None:
        """The handlers from before :meth:`install`; but the job's warning signal, which Slurm
        may still send (ahead of the time limit) after the run ended, is then ignored rather
        than left to its default action, which would end a finished run with 128+N."""
        for signum, handler in self._previous.items():
            if signum == self.warning and handler in (signal.SIG_DFL, None):
                # A handler, not SIG_IGN: an ignored signal stays ignored in every program
                # this process starts later, which would then never stop on it.
                ignore_until_exit(signum)
            else:
                signal.signal(signum, handler)
        self._previous.clear()

    def ignore_from_now_on(self) -> None:
        """The warning signal and SIGTERM do nothing from now on (a process about to exit)."""
        for signum in {self.warning, signal.SIGTERM}:
            ignore_until_exit(signum)

    def rehearse(self) -> None:
        """Record the warning signal as if it had arrived (``preempt.stop_at_step``, or the
        job's end near without one)."""
        self.received.add(self.warning)

    def stop_without_requeue(self) -> None:
        """Record a stop that asks for no requeue, as SIGTERM alone does (``monitor.idle_stop``:
        a requeued job would hold its idle GPU again)."""
        self.received.add(signal.SIGTERM)

    @property
    def requested(self) -> bool:
        return bool(self.received)

    @property
    def wants_requeue(self) -> bool:
        """The warning signal (preemption, time limit ahead) asks for a requeue; SIGTERM alone
        (scancel) asks only to stop cleanly."""
        return self.warning in self.received


class StepAgreement:
    """Every rank learns whether ANY rank wants to stop (or save), at the same step.

    Each call sends this step's flags and returns the agreed flags of the previous call: the
    all-reduce runs in the background during the step in between, so the hot loop never
    waits for it, and all ranks act on the same decision at the same step.
    """

    def __init__(self, group: Any | None) -> None:
        self.group = group
        self._pending: Any | None = None
        self._flags = torch.zeros(2)

    def exchange(self, stop: bool, save: bool) -> tuple[bool, bool]:
        agreed = (False, False)
        if self._pending is not None:
            self._pending.wait()
            agreed = (bool(self._flags[0] > 0), bool(self._flags[1] > 0))
        self._flags = torch.tensor([float(stop), float(save)])
        if self.group is None:
            self._pending = None
            return agreed[0] or stop, agreed[1] or save
        self._pending = dist.all_reduce(self._flags, group=self.group, async_op=True)
        return agreed

    def close(self) -> None:
        """Finish the collective in flight, so the group is quiet before teardown."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
