"""Each rank's wait, at the end of its backward, for DDP's gradient all-reduce: the part of
the step spent on the other ranks and the network, apart from the backward's own compute.

DDP all-reduces the gradients bucket by bucket while the backward still runs, and its
backward returns once the last bucket is summed. The last bucket (``GradBucket.is_last``,
the first layers' gradients) is ready when the backward's compute is done, so the time from
its being ready to its sum being done is what the rank waited: for a slower rank to reach
the same bucket, and for the network. A fast rank waits there for a slow one.

It is timed, where ``monitor.time_gradient_sync`` asks for it, through a DDP communication
hook that reduces exactly as DDP's own (each gradient times 1/world size, a dense bucket's
in one multiply as DDP's copy into the bucket does, then a sum): the same bits as without
it. Off by default: the hook is a Python call, a multiply and a callback more a bucket
(tens of µs a bucket on a CPU, see bench/README.md; DDP's buckets hold 25 MB each).
Refused with the DDP options under which DDP divides otherwise
(``gradient_as_bucket_view``, ``batched_grad_copy``).
DDP takes one communication hook a model, so it is registered at the end of the model's
first training forward, and only where none is registered by then (the script's own,
PowerSGD or fp16 compression, DDP's for an optimizer in the backward): those are kept and
the wait is not timed. A hook the script registers after that forward DDP refuses. CUDA
events on a GPU (read once done: nothing waits for the GPU), the clock on a CPU. Not timed:
under FSDP (its reduce-scatters are waited for inside the backward's hooks), steps inside
``no_sync`` (they reduce nothing). Under DDP's ``join(divide_by_initial_world_size=False)``
DDP divides by the ranks still active, which a hook cannot know: the backward raises.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.monitor.forward import MOST_EVENTS, ForwardTally


class GradientSyncMeter:
    """This rank's seconds waiting for its DDP models' last gradient bucket since the last
    :meth:`take`, from :meth:`attach` to :meth:`detach` (``enabled``: monitor
    .time_gradient_sync; ``say``: this rank speaks for all)."""

    def __init__(
        self,
        device: torch.device,
        enabled: bool = False,
        say: bool = False,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._cuda = device.type == "cuda"
        self._enabled = enabled
        self._say = say
        self._clock = clock or time.perf_counter
        #: Waits finished (seconds on a CPU, event pairs on a GPU), appended where the
        #: all-reduce's future runs its callback: a deque, whose append and popleft are
        #: atomic.
        self._finished: collections.deque[Any] = collections.deque()
        #: The waits taken off ``_finished``: their seconds, and the GPU's event pairs not
        #: done yet (read as the forward's are).
        self._unread = ForwardTally()
        #: The forward hooks waiting to register, by the id of their model.
        self._handles: dict[int, Any] = {}
        self._seen: list[DistributedDataParallel] = []
        self._models: list[DistributedDataParallel] = []
        self._timing = False

    def __deepcopy__(self, memo: dict[int, Any]) -> GradientSyncMeter:
        """One meter a run: a model copied whole (hooks and all) keeps this one."""
        return self

    def check_options(self, ddp_options: Mapping[str, Any]) -> None:
        """Refuse, where the wait is timed, the DDP options under which DDP divides the
        gradients in a way a hook cannot repeat bit for bit (in place in the bucket, or in
        one batch after copying)."""
        for option in ("gradient_as_bucket_view", "batched_grad_copy"):
            if self._enabled and ddp_options.get(option):
                raise HpcDdpError(
                    f"monitor.time_gradient_sync=true with DistributedDataParallel({option}="
                    "True): DDP then divides the gradients in a way the timing hook cannot "
                    "repeat bit for bit",
                    f"leave {option} out, or monitor.time_gradient_sync out (off)",
                )

    def attach(self, model: DistributedDataParallel) -> None:
        """Time ``model``'s wait from its first training forward on (if the script registers
        no communication hook of its own before that forward ends) until :meth:`detach`."""
        if not self._enabled:
            return
        self._timing = True
        self._handles[id(model)] = model.register_forward_hook(self._register_once)

    def _register_once(self, module: Any, _args: Any, _output: Any) -> None:
        """After a training forward (in its first, DDP registers the hooks of its own, such
        as an optimizer's in the backward): register the timing hook, once."""
        if not torch.is_grad_enabled() or any(module is seen for seen in self._seen):
            return
        self._seen.append(module)
        handle = self._handles.pop(id(module), None)
        if handle is not None:
            handle.remove()  # torch's fast call path again
        if not self._timing:
            return
        group = module.process_group
        scale = 1.0 / group.size()

        def reduce(state: Any, bucket: Any) -> Any:
            return self._reduce(module, group, scale, bucket)

        # DDP compares a hook's annotations to its own types: these are strings here.
        reduce.__annotations__ = {}
        try:
            # DDP's logging data names the hook registered, if any (DDP has no public
            # query); the group is held by the hook, not as its state, which a DDP model
            # copied whole would copy.
            found = module._get_ddp_logging_data().get("comm_hook")
            if not found and not getattr(module, "_use_python_reducer", False):
                module.register_comm_hook(None, reduce)
                self._models.append(module)
                return
        except (AssertionError, RuntimeError) as error:  # a hook DDP's logger never saw
            found = str(error)
        if self._say:
            get_logger().info(
                "monitor.time_gradient_sync: the model has a communication hook of its own "
                f"({found or 'the Python reducer'}), kept: the wait for the gradients' "
                "all-reduce is not timed"
            )

    def _reduce(self, module: Any, group: Any, scale: float, bucket: Any) -> Any:
        """DDP's own reduction of ``bucket`` (the same bits, through the group's own
        all-reduce as DDP's: torch.distributed.all_reduce's checks cost more than a small
        model's backward), the last bucket's wait timed."""
        if not getattr(module, "_divide_by_initial_world_size", True):
            raise HpcDdpError(
                "monitor.time_gradient_sync=true under DistributedDataParallel.join("
                "divide_by_initial_world_size=False): DDP then divides the gradients by the "
                "ranks still active, which the timing hook cannot know",
                "leave divide_by_initial_world_size out, or monitor.time_gradient_sync out",
            )
        started = self._started() if bucket.is_last() and self._timing else None
        buffer = bucket.buffer()
        if buffer.is_sparse:  # DDP divides a sparse gradient, and multiplies a dense one
            buffer.div_(group.size())
        else:
            buffer.mul_(scale)
        future = group.allreduce([buffer]).get_future()
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
        """Stop timing (the run ended). A registered hook stays, as DDP keeps it, and goes on
        reducing as DDP would, untimed."""
        self._timing = False
        for handle in self._handles.values():
            handle.remove()
        self._handles = {}
        self._seen, self._models = [], []


def _summed(done: torch.futures.Future[Any]) -> torch.Tensor:
    """The summed bucket, from the all-reduce's future."""
    return done.value()[0]  # type: ignore[no-any-return]
