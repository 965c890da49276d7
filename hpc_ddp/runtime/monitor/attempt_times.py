"""The seconds an attempt spends in each part the run itself can see, as the loop, the
checkpointer and the evaluation loaders count them on one rank; rank 0's become the
attempt's account (:mod:`hpc_ddp.runtime.monitor.account`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

#: How an attempt's ending is charged: an agreed stop, or the end after the last step.
Ending = Literal["stop", "end"]


def never_stopped() -> float:
    """No time in which the process did not run (no looks find any)."""
    return 0.0


@dataclass(frozen=True)
class EndingReading:
    """The attempt's ending and suspended seconds read at one instant
    (:meth:`AttemptTimes.reading`)."""

    how: Ending
    ending_s: float
    suspended_s: float
    #: Checkpoint, evaluation and ending time (:attr:`AttemptTimes.paused_s`) then.
    paused_s: float


@dataclass(frozen=True)
class StepsMark:
    """The paused and suspended seconds when ``run.steps`` began (:meth:`AttemptTimes.mark`)."""

    paused_s: float
    suspended_s: float


@dataclass
class AttemptTimes:
    """Seconds this rank spent in each part the run itself can see (the loop, the
    checkpointer and the evaluation loaders add to it)."""

    resume_s: float = 0.0
    checkpoint_s: float = 0.0
    evaluation_s: float = 0.0
    #: Time inside ``run.steps`` without the checkpoints and evaluations made there.
    steps_s: float = 0.0
    #: Checkpoint and evaluation time before the first ``run.steps`` (None: not yet).
    paused_before_training_s: float | None = None
    clock: Callable[[], float] = time.perf_counter
    #: Seconds this process did not run so far (:meth:`ProcessStops.so_far
    #: <hpc_ddp.runtime.preempt.liveness.ProcessStops.so_far>`): out of every part it fell in.
    suspended: Callable[[], float] = never_stopped
    #: Spans being counted now: only the outermost counts (an evaluation that saves, two
    #: evaluation loaders zipped), so no second counts twice.
    _open: int = field(default=0, init=False, repr=False)
    #: Once the attempt began to end: how (stop or end), when, and the checkpoint,
    #: evaluation and suspended time then.
    _ending: tuple[Ending, float, float, float] | None = field(default=None, init=False, repr=False)
    #: Suspended seconds before training began (a part of the start-up's wall time).
    suspended_before_training_s: float = field(default=0.0, init=False)

    @property
    def paused_s(self) -> float:
        """Checkpoint, evaluation and ending time so far (the steps' own time leaves it
        out: a stop agreed inside ``run.steps`` is not a step)."""
        return self.checkpoint_s + self.evaluation_s + self.ending_s()[1]

    def training_began(self) -> None:
        """Training begins (the first ``run.epochs``/``run.steps``): the checkpoints and
        evaluations so far were part of the start, those after are not."""
        if self.paused_before_training_s is None:
            self.paused_before_training_s = self.checkpoint_s + self.evaluation_s
            self.suspended_before_training_s = self.suspended()

    def begin_ending(self, how: Ending) -> None:
        """The attempt begins to end (the ranks agreed to stop, or ``run.finish()``); what
        follows is charged to ``how``, less its checkpoints and evaluations. Only the first
        call counts: a stop's end is part of the stop."""
        if self._ending is None:
            paused = self.checkpoint_s + self.evaluation_s
            self._ending = (how, self.clock(), paused, self.suspended())

    def ending_s(self, suspended_now: float | None = None) -> tuple[Ending, float]:
        """How the attempt is ending and the seconds since it began to (0 before);
        ``suspended_now``: the suspended seconds read now (read here when not given)."""
        if self._ending is None:
            return "end", 0.0
        how, began, paused, suspended = self._ending
        spent = self.clock() - began - (self.checkpoint_s + self.evaluation_s - paused)
        now = self.suspended() if suspended_now is None else suspended_now
        return how, max(0.0, spent - (now - suspended))

    def reading(self) -> EndingReading:
        """How the attempt is ending, for how long, and the suspended seconds, now: read
        before the end's wall time, so a pause between the two reads is not counted twice."""
        suspended = self.suspended()
        how, ending = self.ending_s(suspended)
        paused = self.checkpoint_s + self.evaluation_s + ending
        return EndingReading(how, ending, suspended, paused)

    def mark(self) -> StepsMark:
        """Where the paused and suspended time stand as ``run.steps`` begins (for
        :meth:`add_steps`)."""
        return StepsMark(self.paused_s, self.suspended())

    def ran_s(self, seconds: float, began: StepsMark) -> float:
        """``seconds`` since ``began`` (:meth:`mark` then) less the time the process did not
        run meanwhile."""
        return max(0.0, seconds - max(0.0, self.suspended() - began.suspended_s))

    def add_steps(self, seconds: float, began: StepsMark) -> None:
        """``seconds`` inside ``run.steps`` as steps, less the checkpoints and evaluations
        made there and the time the process did not run (``began``: :meth:`mark` then)."""
        if self.paused_before_training_s is None:
            self.paused_before_training_s = began.paused_s
            self.suspended_before_training_s = began.suspended_s
        paused = self.paused_s - began.paused_s
        self.steps_s += max(0.0, self.ran_s(seconds, began) - paused)

    @contextmanager
    def in_steps(self) -> Iterator[None]:
        """The time inside as steps (:meth:`add_steps`), however it is left."""
        began, started = self.mark(), self.clock()
        try:
            yield
        finally:
            self.add_steps(self.clock() - started, began)

    @contextmanager
    def counting(
        self,
        part: Literal["resume", "checkpoint", "evaluation"],
    ) -> Iterator[None]:
        """The time inside counted as ``part``, unless it is inside another span."""
        clock = self.clock
        started, suspended, outermost = clock(), self.suspended(), self._open == 0
        self._open += 1
        try:
            yield
        finally:
            self._open -= 1
            if outermost:
                name = f"{part}_s"
                spent = clock() - started - (self.suspended() - suspended)
                setattr(self, name, getattr(self, name) + max(0.0, spent))
