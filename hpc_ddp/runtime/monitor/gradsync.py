"""Each rank's wait, at the end of its backward, for DDP's gradient all-reduce: the part of
the step spent on the other ranks and the network, apart from the backward's own compute.

DDP all-reduces the gradients bucket by bucket while the backward still runs. Once the
autograd graph is done (every gradient computed), DDP's reducer waits for the buckets'
sums, in a callback it queues on autograd's engine when its last bucket is ready. A fast
rank waits there for a slow one to reach the same bucket, and every rank for the network.

Timed, where ``monitor.time_gradient_sync`` asks for it, with two callbacks of autograd's
own: a hook on one parameter's gradient queues the first while the graph runs (before the
reducer's, which is queued when its last bucket is ready: after every gradient), and that
one queues the second behind the reducer's. The time between them is the reducer's wait.
DDP reduces as it always does (its own bits, a communication hook of the script's own,
any DDP option): the timer reads the clock, nothing more. Its cost is a Python call and two
callbacks a backward (a few µs, see bench/README.md), whatever the buckets. CUDA events on
a GPU (read once done: nothing waits for the GPU), the clock on a CPU. Not timed: under
FSDP (its reduce-scatters are waited for inside the backward's hooks), steps inside
``no_sync`` (they reduce nothing), a step in which the hooked parameter (the model's last,
whose gradient is among the first) gets no gradient.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import Variable
from torch.nn.parallel import DistributedDataParallel

from hpc_ddp.runtime.monitor.forward import MOST_EVENTS, ForwardTally


class GradientSyncMeter:
    """This rank's seconds in its DDP models' wait for the gradients' all-reduce since the
    last :meth:`take`, from :meth:`attach` to :meth:`detach` (``enabled``:
    monitor.time_gradient_sync)."""

    def __init__(
        self,
        device: torch.device,
        enabled: bool = False,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._cuda = device.type == "cuda"
        self._enabled = enabled
        self._clock = clock or time.perf_counter
        #: Waits finished (seconds on a CPU, event pairs on a GPU), appended by autograd's
        #: engine (on a GPU, from its device threads): a deque, whose append and popleft are
        #: atomic.
        self._finished: collections.deque[Any] = collections.deque()
        #: The waits taken off ``_finished``: their seconds, and the GPU's event pairs not
        #: done yet (read as the forward's are).
        self._unread = ForwardTally()
        self._handles: list[Any] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> GradientSyncMeter:
        """One meter a run: a model copied whole keeps this one."""
        return self

    def attach(self, model: DistributedDataParallel) -> None:
        """Time ``model``'s wait at the end of each backward until :meth:`detach`."""
        trained = [p for p in model.module.parameters() if p.requires_grad]
        if not self._enabled or not trained:
            return

        def gradient_arrived(_parameter: torch.Tensor) -> None:
            if model.require_backward_grad_sync:  # not inside no_sync
                Variable._execution_engine.queue_callback(self._graph_done)

        self._handles.append(trained[-1].register_post_accumulate_grad_hook(gradient_arrived))

    def _graph_done(self) -> None:
        """Every gradient computed: the reducer's wait is next; time it to its end."""
        if not self._cuda:
            started = self._clock()
            Variable._execution_engine.queue_callback(lambda: self._reduced(started))
        elif not torch.cuda.is_current_stream_capturing():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            Variable._execution_engine.queue_callback(lambda: self._reduced(event))

    def _reduced(self, started: Any) -> None:
        """The reducer's callback is done: the sums are in the gradients (on a GPU, the
        stream waits for them: an event marks when)."""
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._finished.append((started, end))
        else:
            self._finished.append(self._clock() - started)

    def take(self) -> float | None:
        """Seconds waited since the last take (on a GPU, the waits finished; the others are
        read at a later take); None where no model's wait is timed."""
        if not self._handles:
            return None
        tally = self._unread
        while self._finished:
            wait = self._finished.popleft()
            if isinstance(wait, float):
                tally.seconds += wait
            else:
                tally.events.append(wait)
        tally.read_events(keep=MOST_EVENTS)
        seconds, tally.seconds = tally.seconds, 0.0
        return seconds

    def detach(self) -> None:
        """Stop timing (the run ended): the hooks are removed."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
