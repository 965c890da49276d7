"""Each rank's time in its model's training forward, and the FLOPs of one.

Under DDP every rank's step lasts as long as the slowest one's (the others wait in the
gradients' all-reduce), so the time between steps cannot name a slow rank. The forward holds
no collective of DDP's (its buffers are broadcast before the wrapped module is called), so
its length is the rank's own compute: a slow GPU, a throttled node or a larger batch shows
there. It is timed with CUDA events on a GPU (read once done: nothing waits for the GPU)
and with the clock on a CPU; a forward without gradients (an evaluation's) is not timed.

The FLOPs are counted once, on the first training forward (see
:mod:`hpc_ddp.runtime.monitor.flops`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.monitor.flops import MapTensors, flop_text, training_flops

#: CUDA event pairs kept unread at most (a script that wraps a model and never closes a
#: log interval): past it the oldest are read or dropped.
MOST_EVENTS = 4096


def _nothing(*_: Any) -> None:
    return None


#: torch.compiler.is_compiling (torch >= 2.3), else torch._dynamo's.
_is_compiling = getattr(torch.compiler, "is_compiling", None) or torch._dynamo.is_compiling


class Hook:
    """One of the meter's hooks on the user's module. Traced by torch.compile it does
    nothing but say so (a Python clock in the graph would break it). A copy of the module
    (an EMA's ``copy.deepcopy``) and a module saved whole (``torch.save(model)``) get a hook
    that does nothing in its place, so the copy is not timed and the module can be pickled."""

    def __init__(self, call: Callable[..., None], compiled: Callable[[], None] = _nothing) -> None:
        self.call, self.compiled = call, compiled

    def __call__(self, *args: Any) -> None:
        if _is_compiling():
            self.compiled()
        else:
            self.call(*args)

    def __deepcopy__(self, memo: dict[int, Any]) -> Hook:
        return Hook(_nothing)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (Hook, (_nothing,))


class ForwardTake(NamedTuple):
    """A rank's training forwards since the last take: their seconds, their number, and the
    FLOPs counted for them with their backwards (None: some forward's model not counted)."""

    seconds: float
    forwards: int
    flops: float | None


class ForwardMeter:
    """This rank's seconds in the training forwards (with gradients, in training mode) of
    the models it is attached to since the last :meth:`take`; where asked, each model's
    FLOPs of a training forward and its backward, counted on its first (:meth:`flops_of`)."""

    def __init__(
        self,
        device: torch.device,
        count_flops: bool,
        map_tensors: MapTensors,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``map_tensors`` walks a forward's ``(args, kwargs)`` (for the count); ``clock``
        times forwards on a CPU (None: ``time.perf_counter``)."""
        self._device = device
        self._map_tensors = map_tensors
        self._cuda = device.type == "cuda"
        self._clock = clock or time.perf_counter
        self._counting = count_flops
        #: True once a model's forward is timed (a script's own DDP is not).
        self.attached = False
        #: True once a hook ran inside torch.compile's tracing: that model is not timed.
        self.compiled = False
        self._said_compiled = False
        self._handles: list[RemovableHandle] = []
        self._flops: dict[int, float | None] = {}  # by id(module); None: could not count
        self._seconds, self._forwards, self._counted_flops, self._uncounted = 0.0, 0, 0.0, 0
        self._started: float | None = None
        self._events: list[tuple[Any, Any]] = []  # CUDA (start, end) pairs not read yet
        #: One entry per forward under way, outermost first: whether it is timed.
        self._open: list[bool] = []

    def attach(self, module: nn.Module) -> None:
        """Time ``module``'s training forwards until :meth:`detach`."""
        before = Hook(lambda _module, args, kwargs: self._before(module, args, kwargs))
        after = Hook(lambda *_: self._after(), self._saw_compiled)
        self._handles += [
            module.register_forward_pre_hook(before, with_kwargs=True),
            module.register_forward_hook(after, always_call=True),
        ]
        self.attached = True

    def _saw_compiled(self) -> None:
        self.compiled = True

    def timing(self, main: bool) -> bool:
        """Whether the forwards are timed: a model is attached, and not compiled (which
        ``main`` says once)."""
        if self.compiled and main and not self._said_compiled:
            self._said_compiled = True
            get_logger().info(
                "monitor: the wrapped model runs under torch.compile, so its forward is not "
                "timed (no interval/forward_percent, no slowest rank) nor its FLOPs counted. "
                "HINT: monitor.flops_per_sample gives the TFLOP/s and MFU"
            )
        return self.attached and not self.compiled

    def detach(self) -> None:
        """Take the hooks off every module (the run ended: a model left as it came, which
        TorchScript can script)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def flops_of(self, module: nn.Module) -> float | None:
        """The FLOPs counted for a training forward of ``module`` and its backward (None:
        not counted, or it could not be)."""
        return self._flops.get(id(module))

    def _before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # The outermost forward of a training step (an evaluation's, without gradients or
        # in eval mode, is the evaluation's time; a model called inside another is in its
        # caller's).
        timed = not self._open and torch.is_grad_enabled() and module.training
        if timed and self._counting and id(module) not in self._flops:
            self._flops[id(module)] = self._count(module, args, kwargs)
        self._open.append(timed)
        if not timed:
            return
        self._forwards += 1
        flops = self._flops.get(id(module))
        if flops is None:
            self._uncounted += 1
        else:
            self._counted_flops += flops
        if self._cuda:
            if torch.cuda.is_current_stream_capturing():  # no event inside a CUDA graph
                self._open[-1] = False
                return
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events.append((start, None))
        else:
            self._started = self._clock()

    def _after(self) -> None:
        if not self._open or not self._open.pop():
            return
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events[-1] = (self._events[-1][0], end)
            if len(self._events) > MOST_EVENTS:
                self._read_events(keep=MOST_EVENTS // 2)
        elif self._started is not None:
            self._seconds += self._clock() - self._started
            self._started = None

    def _read_events(self, keep: int) -> None:
        """Add up the finished pairs; keep at most ``keep`` of the others."""
        waiting = []
        for start, end in self._events:
            if end is not None and end.query():
                self._seconds += start.elapsed_time(end) / 1000.0
            elif end is not None:
                waiting.append((start, end))
        self._events = waiting[-keep:] if keep else []

    def take(self) -> ForwardTake:
        """The training forwards since the last take; on a GPU the seconds of those it has
        finished, the others read at a later take. Called between steps: a forward left
        open (ended by an exception its hook did not see) is closed."""
        self._open, self._started = [], None
        if self._cuda:
            self._read_events(keep=MOST_EVENTS)
        counted = self._counting and not self._uncounted and self._forwards > 0
        taken = ForwardTake(self._seconds, self._forwards, self._counted_flops if counted else None)
        self._seconds, self._forwards, self._counted_flops, self._uncounted = 0.0, 0, 0.0, 0
        return taken

    def _count(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> float | None:
        started = time.perf_counter()
        name = type(module).__name__
        try:
            flops = training_flops(module, args, kwargs, self._map_tensors, self._device)
        except Exception as error:  # the model's own code, run on shapes: any error it raises
            first = str(error).splitlines()[0] if str(error) else ""
            get_logger().info(
                f"monitor: the FLOPs of {name} could not be counted on the meta device "
                f"({type(error).__name__}: {first}): no interval/tflops or MFU. HINT: set "
                "monitor.flops_per_sample (about 6 x parameters x tokens per sample for a "
                "transformer)"
            )
            return None
        if not flops:
            get_logger().info(
                f"monitor: the forward and backward of {name} hold no operation "
                "FlopCounterMode counts: no interval/tflops or MFU. HINT: set "
                "monitor.flops_per_sample"
            )
            return None
        get_logger().info(
            f"monitor: a training forward of {name} and its backward is {flop_text(flops)} "
            f"(counted on the meta device from the first, in {time.perf_counter() - started:.2f}"
            " s); monitor.flops_per_sample overrides it"
        )
        return float(flops)
