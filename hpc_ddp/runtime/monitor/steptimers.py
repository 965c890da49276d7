"""Each rank's timers of the step's parts, read into its slot of the interval's all-reduce
(see :mod:`hpc_ddp.runtime.monitor.paces` for how rank 0 reads the slots, apart from these
so that the views import it without torch), and the optimizer's timer.

The optimizer's steps are a part of the step apart from the backward and the wait for the
other ranks. They are timed through torch's global optimizer step hooks
(``register_optimizer_step_pre_hook`` and ``..._post_hook``), so every ``torch.optim``
optimizer of the script is timed without being handed to the toolkit, the step a
``GradScaler`` makes included (not its unscale and inf check, which run before; nor a step
it skips). A step inside another (an optimizer that wraps one) is in its caller's time.
What runs inside a step is in it: the closure of an optimizer that takes one (LBFGS), the
collectives of ``ZeroRedundancyOptimizer``. CUDA events on a GPU (read once done: nothing
waits for the GPU), the clock on a CPU, as for the forward
(:mod:`hpc_ddp.runtime.monitor.forward`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from hpc_ddp.runtime.monitor.datawait import DataWait
from hpc_ddp.runtime.monitor.forward.meter import ForwardMeter, ForwardTake
from hpc_ddp.runtime.monitor.forward.timed import MOST_EVENTS, ForwardTally
from hpc_ddp.runtime.monitor.gradsync import GradientSyncMeter
from hpc_ddp.runtime.monitor.paces import NOT_TIMED


class OptimizerMeter:
    """This rank's seconds in optimizer steps since the last :meth:`take`, from
    :meth:`attach` to :meth:`detach`."""

    def __init__(self, device: torch.device, clock: Callable[[], float] | None = None) -> None:
        self._cuda = device.type == "cuda"
        self._clock = clock or time.perf_counter
        self._tally = ForwardTally()
        self._started: Any = None
        self._handles: list[Any] = []

    def attach(self) -> None:
        """Time every optimizer step of the process from now on."""
        if not self._handles:
            self._handles = [
                register_optimizer_step_pre_hook(self._before),
                register_optimizer_step_post_hook(self._after),
            ]

    def detach(self) -> None:
        """Stop timing (the run ended)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        tally = self._tally
        tally.depth += 1
        if tally.depth > 1:
            return
        tally.forwards += 1
        if not self._cuda:
            self._started = self._clock()
        elif not torch.cuda.is_current_stream_capturing():
            self._started = torch.cuda.Event(enable_timing=True)
            self._started.record()

    def _after(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        tally = self._tally
        tally.depth = max(0, tally.depth - 1)
        if tally.depth:
            return
        started, self._started = self._started, None
        if started is None:
            return
        if not self._cuda:
            tally.seconds += self._clock() - started
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        tally.events.append((started, end))
        if len(tally.events) > MOST_EVENTS:
            tally.read_events(keep=MOST_EVENTS // 2)

    def take(self) -> float | None:
        """Seconds in the optimizer steps since the last take (on a GPU, those finished; the
        others are read at a later take); None where no step was taken nor read."""
        tally = self._tally
        tally.read_events(keep=MOST_EVENTS)
        taken = tally.seconds if tally.forwards or tally.seconds else None
        tally.seconds, tally.forwards = 0.0, 0
        # Between steps: a step that raised (torch runs no post hook then) is over.
        tally.depth, self._started = 0, None
        return taken


class StepTimers:
    """This rank's timers of the step's parts, read into its slot as each interval closes:
    the wait inside the loader's ``next`` (the loop times it), the wrapped models' forward,
    the optimizers' steps (torch's global step hooks, from now to :meth:`close`) and the
    wait for the gradients' all-reduce."""

    def __init__(
        self, forward: ForwardMeter, gradient_sync: GradientSyncMeter, device: torch.device
    ) -> None:
        self.data_wait = DataWait()
        #: The ranks' agreement on a stop (each check's exchange, where a rank waits for
        #: the slowest to reach the step).
        self.stop_agreement = DataWait()
        self.forward = forward
        self.gradient_sync = gradient_sync
        self.optimizer = OptimizerMeter(device)
        self.optimizer.attach()

    def take(self) -> tuple[tuple[float, float, float, float, float], ForwardTake]:
        """The seconds since the last take, in slot order (data wait, forward, optimizer,
        gradient sync, stop agreement; :data:`NOT_TIMED` for a part not timed), and the
        forward's take."""
        forward = self.forward.take()
        optimizer, sync = self.optimizer.take(), self.gradient_sync.take()
        seconds = (
            self.data_wait.take(),
            forward.seconds,
            NOT_TIMED if optimizer is None else optimizer,
            NOT_TIMED if sync is None else sync,
            self.stop_agreement.take(),
        )
        return seconds, forward

    def close(self) -> None:
        """Stop timing (the run ended): every model gets its forward back, no global hook
        is left."""
        try:
            self.forward.detach()
        finally:
            try:
                self.gradient_sync.detach()
            finally:
                self.optimizer.detach()
