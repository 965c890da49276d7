"""Each rank's wait, at the end of its backward, for DDP's gradient all-reduce: the part of
the step spent on the other ranks and the network, apart from the backward's own compute.

DDP all-reduces the gradients bucket by bucket while the backward still runs. Once the
autograd graph is done (every gradient computed), DDP's reducer waits for the buckets'
sums, in a callback it queues on autograd's engine when its last bucket is ready. A fast
rank waits there for a slow one to reach the same bucket, and every rank for the network.

Timed (unless ``monitor.time_gradient_sync`` is false) with two callbacks of autograd's
own: a hook on one of the reducer's parameters (the model's last, whose gradient is usually
among the first) queues the first while the graph runs, before the reducer's own (autograd
runs a parameter's gradient hooks before the reducer hears of that gradient, and the
reducer queues its callback once it has heard of them all); that one queues the second,
behind the reducer's. The time between them is the reducer's wait, with its copy of the
sums into the gradients. DDP reduces as it always does (its own bits, a communication hook
of the script's own, any DDP option): the timer reads the clock, nothing more. Its cost is
a Python call and two callbacks a backward, whatever the buckets (bench/README.md). CUDA
events on a GPU (read once done: nothing waits for the GPU), the clock on a CPU.

Not timed (the interval then says so, rather than 0): under FSDP (its reduce-scatters are
waited for inside the backward's hooks); steps whose forward ran inside ``no_sync`` (they
reduce nothing); a step in which the hooked parameter gets no gradient; the first step of
a ``static_graph`` model (DDP reduces it all in one callback queued when the backward
starts); DDP's Python reducer (compiled autograd). Read short: a step in which a forward
without gradients (an evaluation) ran between the training forward and its backward (DDP
then forgets that the backward reduces; the step reads as not timed), and a hooked
parameter inside a reentrant activation checkpoint (``use_reentrant=True``: its hook runs
in the checkpoint's own backward, whose end is not the reducer's). Several DDP models in
one backward are counted once, from the first hooked gradient on.
"""

from __future__ import annotations

import collections
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import Variable
from torch.nn.parallel import DistributedDataParallel

from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.monitor.forward.timed import MOST_EVENTS, ForwardTally


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
        self._device = device
        self._cuda = device.type == "cuda"
        self._enabled = enabled
        self._clock = clock or time.perf_counter
        #: Waits finished (seconds on a CPU, event pairs on a GPU), appended by autograd's
        #: engine (on a GPU, from its device threads): a deque, whose append and popleft are
        #: atomic; bounded, as a script that never ends an interval never takes them.
        self._finished: collections.deque[Any] = collections.deque(maxlen=MOST_EVENTS)
        #: The waits taken off ``_finished``: their seconds, and the GPU's event pairs not
        #: done yet (read as the forward's are).
        self._unread = ForwardTally()
        self._handles: list[Any] = []
        #: The backward (autograd's graph task) whose wait is being timed: one pair of
        #: callbacks a backward, however many models it reduces.
        self._graph_task = -1
        self._failed = False

    def __deepcopy__(self, memo: dict[int, Any]) -> GradientSyncMeter:
        """One meter a run: a model copied whole keeps this one."""
        return self

    def attach(self, model: DistributedDataParallel) -> None:
        """Time ``model``'s wait at the end of each backward until :meth:`detach`."""
        if not self._enabled or getattr(model, "_use_python_reducer", False):
            return
        try:
            self._hook(model)
        except Exception as error:  # run.wrap goes on: the wait is only not timed
            self._say_failed(error)

    def _hook(self, model: DistributedDataParallel) -> None:
        ignored: set[str] = getattr(model, "parameters_to_ignore", set())
        reduced = [
            parameter
            for name, parameter in model.module.named_parameters()
            if parameter.requires_grad and name not in ignored
        ]
        if not reduced:
            return
        held = weakref.ref(model)  # the hook must not keep a dropped model alive
        backwards = [0]

        def gradient_arrived(_parameter: torch.Tensor) -> None:
            ddp = held()
            # DDP decides at the forward whether the backward reduces (no_sync).
            if ddp is None or not ddp.require_forward_param_sync:
                return
            backwards[0] += 1
            if ddp.static_graph and backwards[0] == 1:
                return  # reduced all at once, in a callback queued before this one
            try:
                task = torch._C._current_graph_task_id()
                if task != self._graph_task:
                    self._graph_task = task
                    Variable._execution_engine.queue_callback(self._graph_done)
            except Exception as error:  # the user's backward goes on whatever the timer does
                self._say_failed(error)

        self._handles.append(reduced[-1].register_post_accumulate_grad_hook(gradient_arrived))

    def _graph_done(self) -> None:
        """Every gradient computed: the reducer's wait is next; time it to its end."""
        try:
            if not self._cuda:
                started: Any = self._clock()
            elif torch.cuda.is_current_stream_capturing():
                return
            else:
                started = torch.cuda.Event(enable_timing=True)
                started.record(torch.cuda.current_stream(self._device))
            Variable._execution_engine.queue_callback(lambda: self._reduced(started))
        except Exception as error:  # the reducer's callback must run whatever the timer does
            self._say_failed(error)

    def _reduced(self, started: Any) -> None:
        """The reducer's callback is done: the sums are in the gradients (on a GPU, the
        stream waits for them: an event marks when)."""
        try:
            if self._cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record(torch.cuda.current_stream(self._device))
                self._finished.append((started, end))
            else:
                self._finished.append(self._clock() - started)
        except Exception as error:
            self._say_failed(error)

    def _say_failed(self, error: Exception) -> None:
        if not self._failed:
            self._failed = True
            get_logger().warning(
                f"monitor.time_gradient_sync: the timer failed ({error!r}); the wait for the "
                "gradients' all-reduce is left out where it did"
            )

    def take(self) -> float | None:
        """Seconds waited since the last take (on a GPU, the waits finished; the others are
        read at a later take); None where no model's wait is timed, or no backward was
        since the last take."""
        tally = self._unread
        if not self._handles or not (self._finished or tally.events):
            return None
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
