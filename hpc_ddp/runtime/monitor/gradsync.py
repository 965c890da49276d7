"""Each rank's wait, at the end of its backward, for DDP's gradient all-reduce: the part of
the step spent on the other ranks and the network, apart from the backward's own compute.

DDP all-reduces the gradients bucket by bucket while the backward still runs, and its
backward returns once the last bucket is summed. The last bucket (``GradBucket.is_last``,
the first layers' gradients) is ready when the backward's compute is done, so the time from
its being ready to its sum being done is what the rank waited: for a slower rank to reach
the same bucket, and for the network. A fast rank waits there for a slow one.

It is timed through a DDP communication hook that reduces exactly as DDP's own (each
gradient times 1/world size, a dense bucket's in one multiply as DDP's copy into the bucket
does, then a sum): the same bits as without it. DDP takes one communication hook a model,
so it is registered at the model's first training forward, and only where the script has
registered none by then (its own hook, PowerSGD or fp16 compression, is left alone and
the wait is not timed). CUDA events on a GPU (read once done: nothing waits for the GPU),
the clock on a CPU. Not timed: under FSDP (its reduce-scatters are waited for inside the
backward's hooks), steps inside ``no_sync`` (they reduce nothing).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hpc_ddp.runtime.monitor.forward import MOST_EVENTS


class GradientSyncMeter:
    """This rank's seconds waiting for its DDP models' last gradient bucket since the last
    :meth:`take`, from :meth:`attach` to :meth:`detach`."""

    def __init__(self, device: torch.device, clock: Callable[[], float] | None = None) -> None:
        self._cuda = device.type == "cuda"
        self._clock = clock or time.perf_counter
        #: Waits finished (seconds on a CPU, event pairs on a GPU), appended by the
        #: communication library's thread: a deque, whose append and popleft are atomic.
        self._finished: collections.deque[Any] = collections.deque()
        self._unread: list[tuple[Any, Any]] = []
        self._handles: list[Any] = []
        self._models: list[DistributedDataParallel] = []
        self._timing = False

    @property
    def timed(self) -> bool:
        """Whether a model's wait is timed (its hook registered)."""
        return bool(self._models)

    def attach(self, model: DistributedDataParallel) -> None:
        """Time ``model``'s wait from its first training forward on (if the script registers
        no communication hook of its own before it) until :meth:`detach`."""
        self._timing = True
        handle: Any = None

        def register(_module: Any, _args: Any) -> None:
            if not torch.is_grad_enabled():
                return
            handle.remove()
            self._handles.remove(handle)
            if self._timing and self._register(model):
                self._models.append(model)

        handle = model.register_forward_pre_hook(register)
        self._handles.append(handle)

    def _register(self, model: DistributedDataParallel) -> bool:
        """Register the timing hook on ``model``; False where it has a hook already."""
        # DDP says nowhere public whether a hook is registered; its Python list holds the
        # hooks registered with register_comm_hook, the usual way, and a failed
        # registration would leave an entry there. Compiled autograd's Python reducer
        # calls hooks with (grad, param), not a bucket.
        if getattr(model, "_comm_hooks", None) or getattr(model, "_use_python_reducer", False):
            return False
        group = model.process_group
        try:  # unannotated: DDP compares a hook's annotations to its own types
            model.register_comm_hook(group, lambda state, bucket: self._reduce(state, bucket))
        except RuntimeError:  # a built-in hook (fp16 compression) is registered
            return False
        return True

    def _reduce(self, group: Any, bucket: Any) -> Any:
        """DDP's own reduction of ``bucket`` (the same bits), the last bucket's wait timed."""
        started = self._started() if bucket.is_last() and self._timing else None
        buffer = bucket.buffer()
        size = dist.get_world_size(group)
        if buffer.is_sparse:  # DDP divides a sparse gradient, and multiplies a dense one
            buffer.div_(size)
        else:
            buffer.mul_(1.0 / size)
        future = dist.all_reduce(buffer, group=group, async_op=True).get_future()
        if started is None:
            return future.then(_summed)
        return future.then(lambda done: self._done(started, done))

    def _started(self) -> Any:
        """Now: the clock, or an event on the backward's stream (None while a CUDA graph is
        captured)."""
        if not self._cuda:
            return self._clock()
        if torch.cuda.is_current_stream_capturing():
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _done(self, started: Any, done: torch.futures.Future[Any]) -> torch.Tensor:
        """The last bucket summed (on a GPU the callback's stream waits for the sum)."""
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._finished.append((started, end))
        else:
            self._finished.append(self._clock() - started)
        return _summed(done)

    def take(self) -> float | None:
        """Seconds waited since the last take (on a GPU, the waits finished; the others are
        read at a later take); None where no model's wait is timed."""
        if not self._models:
            return None
        seconds = 0.0
        while self._finished:
            wait = self._finished.popleft()
            if isinstance(wait, float):
                seconds += wait
            else:
                self._unread.append(wait)
        waiting = []
        for start, end in self._unread:
            if end.query():
                seconds += start.elapsed_time(end) / 1000.0
            else:
                waiting.append((start, end))
        self._unread = waiting[-MOST_EVENTS:]
        return seconds

    def detach(self) -> None:
        """Stop timing (the run ended). A registered hook stays, as DDP keeps it, and goes on
        reducing as DDP would, untimed."""
        self._timing = False
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._models = []


def _summed(done: torch.futures.Future[Any]) -> torch.Tensor:
    """The summed bucket, from the all-reduce's future."""
    return done.value()[0]  # type: ignore[no-any-return]
