"""The step boundary: what happens between one optimizer step and the next.

:class:`StepLoop` counts epochs and steps over a loader's (or any iterable's) micro-batches
and, at step boundaries only, calls its named parts: :class:`MetricLog` (interval metrics,
exact epoch sums), :class:`Stopper` (every rank stops after the SAME step), and
:class:`Checkpointer` (periodic, requested and final checkpoints; what they hold). Nothing in
it synchronises the device per step; the stop agreement is a CPU (gloo) all-reduce
overlapped with the next step.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.logs import Progress
from hpc_ddp.runtime.loop.cadence import Cadence
from hpc_ddp.runtime.loop.checkpointer import Checkpointer, check_replicas
from hpc_ddp.runtime.loop.context import RunContext
from hpc_ddp.runtime.loop.intervals import MetricLog
from hpc_ddp.runtime.loop.position import Limits, Position
from hpc_ddp.runtime.loop.stopper import Stopper, start_watchdog
from hpc_ddp.runtime.loop.streams import BatchStream, StreamStates
from hpc_ddp.runtime.place.dist import all_gather_object, same_on_all_ranks
from hpc_ddp.runtime.preempt.watchdog import StallWatchdog

_END = object()


def check_same_steps(steps_per_epoch: int | None, group: Any | None) -> None:
    """Every rank must run the same steps per epoch: a rank that runs fewer leaves the others
    waiting in a collective it never joins. One all-reduce of two numbers per epoch; refused
    on every rank in one line naming each rank's count."""
    if group is None or same_on_all_ranks(
        -1 if steps_per_epoch is None else steps_per_epoch, group
    ):
        return
    counts = all_gather_object(steps_per_epoch, group)
    if len(set(counts)) > 1:
        each = ", ".join(
            f"rank {rank}: {'no end' if count is None else count}"
            for rank, count in enumerate(counts[:8])
        )
        raise HpcDdpError(
            f"the ranks would run different numbers of steps per epoch ({each}"
            f"{', ...' if len(counts) > 8 else ''}) and wait on each other for ever",
            "give every rank the same dataset: its length decides the steps (a per-rank file "
            "list must hold the same number of samples on each rank), or let run.train_loader "
            "shard one dataset by index",
        )


def left_early(step: int, steps_left: float, ran_out: bool) -> str | None:
    """Why a rank left the loop with steps left (None: its steps were done)."""
    if ran_out:
        return f"after step {step}: its batches ran out"
    if steps_left > 0:
        return f"after step {step}: it broke out of the loop (a break, or an exception)"
    return None


@dataclass(frozen=True)
class IntervalStart:
    """Where a log interval began: the clock, the step, and the suspended seconds then."""

    time: float
    step: int
    suspended_s: float

    def until(self, end: IntervalStart) -> tuple[int, float, float]:
        """The interval to ``end``: its steps, the seconds the process ran (what rates
        count) and the seconds it did not."""
        stopped = end.suspended_s - self.suspended_s
        return end.step - self.step, end.time - self.time - stopped, stopped


class StepLoop:
    """Epochs and steps of one run on this rank (see the module docstring)."""

    def __init__(self, context: RunContext, position: Position) -> None:
        self.context = context
        self.position = position
        self.metrics = MetricLog(context)
        self.streams = StreamStates(context.env.rank, context.env.world_size)
        self.checkpointer = Checkpointer(
            context, position, self.metrics, self.streams, self._unwatched
        )
        self.stopper = Stopper(context, position, self.checkpointer)
        self.cadence = Cadence(
            context.config.preempt.check_every_steps,
            context.log_interval,
            context.control_group,
            context.env.is_main,
        )
        self.limits = Limits()
        #: True while a micro-batch that is not the last of its optimizer step is out.
        self.accumulating = False
        self._in_epochs = self._stepping = self._save_requested = self._begun = False
        self._micro = 0
        self._interval = IntervalStart(time.perf_counter(), 0, 0.0)
        self._watchdog: StallWatchdog | None = None

    def begin(self, before_first_step: Callable[[], object]) -> None:
        """Once, before the first step: ``before_first_step`` (the resume), the time account
        told that training begins, the stop agreement, and the garbage collector told that
        everything alive now stays."""
        if self._begun:
            return
        self._begun = True
        before_first_step()
        self.context.times.training_began()
        self.stopper.begin()
        self.metrics.progress = Progress(self.limits.max_steps, enabled=self.context.env.is_main)
        self._watchdog = start_watchdog(self.context, self.position)
        gc.freeze()

    # -- epochs and steps ---------------------------------------------------------------------

    def epochs(self) -> Iterator[int]:
        """The epochs left (a resumed epoch part-way always goes on); marks the run completed
        when they ran to their end."""
        self._in_epochs = True
        try:
            while self.limits.more_epochs(self.position):
                yield self.position.epoch
                self._next_epoch()
        finally:
            self._in_epochs = False
        self.position.completed = True

    def _next_epoch(self) -> None:
        self.position.epoch += 1
        self.position.step_in_epoch = 0

    def steps(self, loader: Any) -> Iterator[Any]:
        """The rest of the current epoch's micro-batches (see :meth:`hpc_ddp.Run.steps`):
        ``loader`` is a TrainLoader or a :class:`BatchStream` over the user's iterable.
        The time account counts all of it as steps, the epoch's start and end (the ranks'
        check of its length, its metrics summed) too, less its checkpoints and evaluations;
        the samples' rate counts the steps' loop only."""
        times = self.context.times
        with times.in_steps():
            position, accum = self.position, loader.grad_accum_steps
            if isinstance(loader, BatchStream):
                self.streams.take(loader, position.resumed_from_step)
            else:
                micro = loader.global_batch_size // (accum * self.context.env.world_size)
                self.metrics.set_batch(micro, accum)
            check_same_steps(loader.steps_per_epoch, self.context.control_group)
            self.metrics.progress.total_steps = self.limits.total_steps(loader.steps_per_epoch)
            left = self.limits.steps_left(position, loader.steps_per_epoch)
            loader.set_position(position.epoch, position.step_in_epoch)
            self.metrics.use_loader(loader)
            started, began = position.clock.start(times)
            self._interval = IntervalStart(started, position.global_step, began.suspended_s)
            self._micro, self._stepping, watchdog = 0, True, self._watchdog
            if watchdog is not None:
                watchdog.arm()
            wanted = left > 0 or loader.steps_per_epoch == 0  # 0: a sized iterable, empty
            fresh_epoch, yielded, ran_out = wanted and position.step_in_epoch == 0, False, False
            try:
                batches = iter(loader) if left > 0 else iter(())
                while left > 0:
                    batch = self.metrics.timers.data_wait.next_of(batches, _END)
                    if batch is _END:
                        ran_out = True
                        break
                    yielded = True
                    if not self.metrics.global_batch_size:
                        self.metrics.measure_batch(batch, accum)
                    self.accumulating = self._micro < accum - 1
                    yield batch
                    if watchdog is not None:
                        watchdog.beat()
                    self._micro = (self._micro + 1) % accum
                    if self._micro == 0:
                        left -= 1
                        self._after_step()
            finally:
                self._stepping, self.accumulating = False, False
                if watchdog is not None:
                    watchdog.disarm(left_early(position.global_step, left, ran_out))
                if self.context.device.type == "cuda":
                    torch.cuda.synchronize(self.context.device)  # the epoch's kernels count too
                position.train_time_s += position.clock.stop()
            if fresh_epoch and not yielded:
                raise no_step_refusal(loader, accum, position.epoch)
            self.metrics.progress.reach(position.global_step, final=True)
            self.metrics.end_epoch(position.epoch, position.global_step)
            if not self._in_epochs:
                self._next_epoch()

    def _after_step(self) -> None:
        position, cadence = self.position, self.cadence
        if position.first_step_unix is None:
            position.first_step_unix = time.time()
        position.global_step += 1
        position.step_in_epoch += 1
        if position.global_step % cadence.log_interval == 0:
            self._close_interval()
        stop, save_now = False, False
        if position.global_step % cadence.check_every == 0:
            stop, save_now = self.stopper.decide(self.metrics.timers.stop_agreement)
            self.metrics.progress.reach(position.global_step)
        if stop or self.stopper.rehearsal_due():
            self.stopper.stop()
        every_steps = self.context.config.checkpoint.every_steps
        requested, self._save_requested = self._save_requested, False
        if save_now or requested or (every_steps and position.global_step % every_steps == 0):
            self.checkpointer.save("requested" if requested else "periodic")

    def _close_interval(self) -> None:
        position, times = self.position, self.context.times
        ended = IntervalStart(time.perf_counter(), position.global_step, times.suspended())
        steps, seconds, stopped = self._interval.until(ended)
        if not self.cadence.calibrated:
            self.cadence.calibrate(steps, seconds)
        self.metrics.close_interval(position.global_step, position.epoch, steps, seconds, stopped)
        self._interval = ended

    # -- at step boundaries, on the user's terms ---------------------------------------------

    def every(self, steps: int) -> bool:
        """Whether the optimizer step about to be taken is one of every ``steps``, once per
        step whatever the accumulation; the stall watchdog then rests until the next
        micro-batch."""
        check_period(steps)
        due = self.position.global_step % steps == 0 and self._micro == 0
        if due and self._watchdog is not None:
            self._watchdog.rest()
        return due

    def request_save(self) -> None:
        """A checkpoint at the end of the optimizer step in progress, or at once between
        steps (every rank asks)."""
        if self._stepping:
            self._save_requested = True
        else:
            self.checkpointer.save("requested")

    def _unwatched(self) -> contextlib.AbstractContextManager[None]:
        """No stall watch while a checkpoint is written: a large one may take longer than
        dist.stall_timeout_s, and its barrier is bounded by dist.timeout_s."""
        return contextlib.nullcontext() if self._watchdog is None else self._watchdog.paused()

    # -- ending ------------------------------------------------------------------------------

    def finish(self) -> dict[str, Any]:
        """After the last step: the final checkpoint, the replica check and the loop's summary."""
        self.metrics.publish()
        self.checkpointer.save("end of training")
        if self.position.last_checkpoint_step != self.position.global_step:
            check_replicas(self.context, self.position)  # not checked by a save at this step
        facts = self.position.summary(self.metrics.global_batch_size)
        return {**facts, "last_checkpoint_save_s": dict(self.checkpointer.last_save_s)}

    def close(self, wait: bool = True) -> None:
        """End the progress display and (``wait``) finish the stop agreement in flight; after
        a failure a peer may be gone, so nothing is waited for then."""
        try:
            self.metrics.close()
        finally:
            self.checkpointer.close()  # torch's global hook, which holds the registry
            if self._watchdog is not None:
                self._watchdog.close()
            self.stopper.close(wait)


def check_period(steps: object) -> None:
    """Refuse a period of :meth:`StepLoop.every` that is not a whole number of steps."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise HpcDdpError(
            f"run.every({steps!r}): the period must be a whole number of steps >= 1",
            "e.g. run.every(200)",
        )


def no_step_refusal(loader: Any, accum: int, epoch: int) -> HpcDdpError:
    """An epoch that began and gave no optimizer step: empty data, or a used-up iterable."""
    given = loader.batches if isinstance(loader, BatchStream) else loader
    return HpcDdpError(
        f"run.steps(): the {type(given).__name__} gave no "
        f"{'batch' if accum == 1 else f'{accum} micro-batches (grad_accum_steps)'} "
        f"in epoch {epoch}: expected at least one optimizer step",
        "check the data is not empty (a DataLoader with drop_last=True and a batch larger "
        "than the data gives none); a generator is used up after one epoch: make a new one "
        "each epoch",
    )
