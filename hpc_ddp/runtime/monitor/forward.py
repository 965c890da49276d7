"""Each rank's time in its model's training forward, and the FLOPs of one.

Under DDP every rank's step lasts as long as the slowest one's (the others wait in the
gradients' all-reduce), so the time between steps cannot name a slow rank. The forward holds
no collective of DDP's (its buffers are broadcast before the wrapped module is called), so
its length is the rank's own compute: a slow GPU, a throttled node or a larger batch shows
there. It is timed with CUDA events on a GPU (read once done: nothing waits for the GPU)
and with the clock on a CPU; a forward without gradients (an evaluation's) is not timed.

The module's ``forward`` is replaced, while the run lasts, by a :class:`TimedForward` that
calls the original: a module with forward hooks takes torch's slow path through
``Module.__call__`` (about ten Python calls more a forward, as much as a small model's step
on a CPU), one with its own ``forward`` attribute keeps the fast one.

The FLOPs are counted once, on the first training forward (see
:mod:`hpc_ddp.runtime.monitor.flops`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.monitor.flops import MapTensors, flop_text, training_flops

#: CUDA event pairs kept unread at most (a script that wraps a model and never closes a
#: log interval): past it the oldest are read or dropped.
MOST_EVENTS = 4096

#: torch.compiler.is_compiling (torch >= 2.3), else torch._dynamo's.
_is_compiling = getattr(torch.compiler, "is_compiling", None) or torch._dynamo.is_compiling

#: A module's FLOPs not counted yet.
_NOT_YET = object()


class ForwardTake(NamedTuple):
    """A rank's training forwards since the last take: their seconds, their number, and the
    FLOPs counted for them with their backwards (None: some forward's model not counted)."""

    seconds: float
    forwards: int
    flops: float | None


@dataclass
class ForwardTally:
    """The training forwards of the attached models since the last take, and the forwards
    under way (a model called inside another is in its caller's time)."""

    seconds: float = 0.0
    forwards: int = 0
    counted_flops: float = 0.0
    uncounted: int = 0
    depth: int = 0
    #: CUDA (start, end) event pairs not read yet.
    events: list[tuple[Any, Any]] = field(default_factory=list)
    #: True once a forward ran inside torch.compile's tracing: that model is not timed.
    compiled: bool = False

    def read_events(self, keep: int) -> None:
        """Add up the finished event pairs; keep at most ``keep`` of the others."""
        waiting = []
        for start, end in self.events:
            if end.query():
                self.seconds += start.elapsed_time(end) / 1000.0
            else:
                waiting.append((start, end))
        self.events = waiting[-keep:] if keep else []


def _untimed(call: Callable[..., Any]) -> Callable[..., Any]:
    return call


class TimedForward:
    """A module's ``forward`` while the meter times it: the original's call, its time added
    to the tally when it is the outermost training forward (with gradients, in training
    mode). Traced by torch.compile it only says so (a Python clock in the graph would break
    it). A copy of the module (an EMA's ``copy.deepcopy``, the FLOP count's meta twin) and
    a module saved whole (``torch.save(model)``) get the original forward, bound to them."""

    def __init__(
        self,
        module: nn.Module,
        tally: ForwardTally,
        clock: Callable[[], float],
        cuda: bool,
        count: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], float | None] | None,
    ) -> None:
        """``count`` gives the FLOPs of the module's first training forward (None: not
        counted)."""
        #: What ``module.forward`` was before (its own attribute, or its class's method).
        self.original: Callable[..., Any] | None = module.__dict__.get("forward")
        self.call: Callable[..., Any] = module.forward
        self.__wrapped__ = self.call  # inspect.signature shows the original's
        self.module, self.tally, self.clock, self.cuda, self.count = (
            module, tally, clock, cuda, count
        )  # fmt: skip
        self.flops: Any = _NOT_YET if count is not None else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling():
            self.tally.compiled = True
            return self.call(*args, **kwargs)
        tally = self.tally
        if tally.depth or not (self.module.training and torch.is_grad_enabled()):
            tally.depth += 1
            try:
                return self.call(*args, **kwargs)
            finally:
                tally.depth -= 1
        flops = self.flops
        if flops is _NOT_YET:
            flops = self.flops = self.count(self.module, args, kwargs)  # type: ignore[misc]
        tally.forwards += 1
        if flops is None:
            tally.uncounted += 1
        else:
            tally.counted_flops += flops
        if self.cuda:
            return self._on_gpu(args, kwargs)
        started = self.clock()
        tally.depth += 1
        try:
            return self.call(*args, **kwargs)
        finally:
            tally.depth -= 1
            tally.seconds += self.clock() - started

    def _on_gpu(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tally = self.tally
        capturing = torch.cuda.is_current_stream_capturing()  # no event inside a CUDA graph
        start = None if capturing else torch.cuda.Event(enable_timing=True)
        if start is not None:
            start.record()
        tally.depth += 1
        try:
            return self.call(*args, **kwargs)
        finally:
            tally.depth -= 1
            if start is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                tally.events.append((start, end))
                if len(tally.events) > MOST_EVENTS:
                    tally.read_events(keep=MOST_EVENTS // 2)

    def remove(self) -> None:
        """Give the module its forward back (if this is still its forward)."""
        if self.module.__dict__.get("forward") is not self:
            return
        if self.original is None:
            del self.module.__dict__["forward"]
        else:
            self.module.__dict__["forward"] = self.original

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., Any]:
        return copy.deepcopy(self.call, memo)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_untimed, (self.call,))


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
        self._clock = clock or time.perf_counter
        self._counting = count_flops
        self._tally = ForwardTally()
        self._timed: list[TimedForward] = []
        self._said_compiled = False

    @property
    def attached(self) -> bool:
        """True once a model's forward is timed (a script's own DDP is not)."""
        return bool(self._timed)

    @property
    def compiled(self) -> bool:
        """True once a timed forward ran inside torch.compile's tracing: not timed."""
        return self._tally.compiled

    def attach(self, module: nn.Module) -> None:
        """Time ``module``'s training forwards until :meth:`detach`."""
        timed = TimedForward(
            module,
            self._tally,
            self._clock,
            self._device.type == "cuda",
            self._count if self._counting else None,
        )
        module.__dict__["forward"] = timed
        self._timed.append(timed)

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
        """Give every module its forward back (the run ended: a model left as it came,
        which TorchScript can script)."""
        for timed in reversed(self._timed):
            timed.remove()

    def flops_of(self, module: nn.Module) -> float | None:
        """The FLOPs counted for a training forward of ``module`` and its backward (None:
        not counted, or it could not be)."""
        for timed in self._timed:
            if timed.module is module and timed.flops is not _NOT_YET:
                return timed.flops  # type: ignore[no-any-return]
        return None

    def take(self) -> ForwardTake:
        """The training forwards since the last take; on a GPU the seconds of those it has
        finished, the others read at a later take."""
        tally = self._tally
        tally.read_events(keep=MOST_EVENTS)
        counted = self._counting and not tally.uncounted and tally.forwards > 0
        taken = ForwardTake(tally.seconds, tally.forwards, tally.counted_flops if counted else None)
        tally.seconds, tally.forwards, tally.counted_flops, tally.uncounted = 0.0, 0, 0.0, 0
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
