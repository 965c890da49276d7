"""The forward a timed module holds while the run lasts (:class:`TimedForward`), what a copy
of it holds (:class:`UntimedForward`), and the tally they add to."""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hpc_ddp.runtime.monitor.flops import dtype_in_use
from hpc_ddp.runtime.monitor.throughput import ComputeDtype

#: CUDA event pairs kept unread at most (a script that wraps a model and never closes a
#: log interval): past it the oldest are read or dropped.
MOST_EVENTS = 4096

#: Looked up once: they are read on every forward.
_is_compiling = torch.compiler.is_compiling
_current_graph_task_id = torch._C._current_graph_task_id

#: A module's FLOPs not counted yet.
NOT_YET = object()


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


#: The copies' untimed forwards not called yet, released when a meter detaches.
_COPIES: weakref.WeakSet[UntimedForward] = weakref.WeakSet()


def copied_forward(module: nn.Module, memo: dict[int, Any]) -> Callable[..., Any]:
    """The forward a deep copy of ``module`` gets: within a copy of the module, an
    :class:`UntimedForward` of the copy; copied alone, the copy's own method (which keeps
    that copy alive)."""
    within = id(module) in memo
    copied = copy.deepcopy(module, memo)
    if within:
        return UntimedForward(copied)
    method: Callable[..., Any] = type(copied).forward.__get__(copied)
    return method


class UntimedForward:
    """What a copy of a timed module (an EMA's ``copy.deepcopy``, the FLOP count's meta twin)
    holds as its ``forward``: at its first call it takes itself off the copy, which then
    runs its class's forward, untimed. It holds the copy weakly, so a copy let go of is
    freed at once (no cycle for the collector to find)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = weakref.ref(module)
        _COPIES.add(self)

    def _method(self) -> Callable[..., Any]:
        """The copy's class forward, bound to it."""
        module = self.__dict__["module"]()
        if module is None:
            raise AttributeError("the module of this forward was freed")
        return type(module).forward.__get__(module)  # type: ignore[no-any-return]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.release()
        return self._method()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # __self__, __func__, __name__, __code__, ...
        method = self._method()
        return method if name == "__wrapped__" else getattr(method, name)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., Any]:
        return copied_forward(self._method().__self__, memo)  # type: ignore[attr-defined]

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (getattr, (self._method().__self__, "forward"))  # type: ignore[attr-defined]

    def release(self) -> None:
        """Take this off the copy now (its first call, or the run ended: the copy is left
        as TorchScript wants it)."""
        module = self.module()
        if module is not None and module.__dict__.get("forward") is self:
            module.__dict__.pop("forward", None)


class TimedForward:
    """A module's ``forward`` while the meter times it: the original's call, its time added
    to the tally when it is the outermost training forward (with gradients, in training
    mode). Traced by torch.compile it only says so (a Python clock in the graph would break
    it). It reads as the original method does (``__name__``, ``__doc__``, ``__code__``,
    ``__self__``, a signature); its ``__func__`` rebound to the module (as some libraries
    wrap a forward) times as it does. A copy of the module (an EMA's ``copy.deepcopy``, the
    FLOP count's meta twin) and a module saved whole (``torch.save(model)``) get an
    :class:`UntimedForward`."""

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
        before = module.__dict__.get("forward")
        if isinstance(before, UntimedForward):  # a copy made during the run, wrapped too
            before.release()
        #: What ``module.forward`` was before (its own attribute, or its class's method).
        self.original: Callable[..., Any] | None = module.__dict__.get("forward")
        self.call: Callable[..., Any] = module.forward
        functools.update_wrapper(self, self.call, updated=())
        self.module, self.tally, self.clock, self.cuda, self.count = (
            module, tally, clock, cuda, count
        )  # fmt: skip
        self.flops: Any = NOT_YET if count is not None else None
        #: The format of its first training forward's matrix multiplies (None: not seen yet,
        #: or not one the peak table has).
        self.dtype: ComputeDtype | None = None
        self._dtype_seen = False
        function = getattr(self.call, "__func__", None)
        if function is not None:
            self.__func__ = functools.wraps(function)(self._function_of(function))

    def _function_of(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if module is self.module:
                return self(*args, **kwargs)
            return function(module, *args, **kwargs)

        return forward

    def __getattr__(self, name: str) -> Any:  # __self__, __name__, __code__, ...
        return getattr(self.__dict__["call"], name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling():
            if not torch.compiler.is_exporting():  # an export is a copy, the model trains on
                self.tally.compiled = True
            return self.call(*args, **kwargs)
        tally = self.tally
        # Inside a backward: activation checkpointing's recomputation, not a forward.
        training = self.module.training and torch.is_grad_enabled()
        if tally.depth or not training or _current_graph_task_id() != -1:
            tally.depth += 1
            try:
                return self.call(*args, **kwargs)
            finally:
                tally.depth -= 1
        if not self._dtype_seen:
            self._dtype_seen = True
            self.dtype = dtype_in_use(self.module, "cuda" if self.cuda else "cpu")
        flops = self.flops
        if flops is NOT_YET:
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
        """Give the module its forward back (if this is still its forward); a wrapper of
        this one that a script kept is no longer timed."""
        self.tally = ForwardTally()
        if self.flops is NOT_YET:
            self.flops = None
        if self.module.__dict__.get("forward") is not self:
            return
        if self.original is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.__dict__["forward"] = self.original

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., Any]:
        if self.original is not None:
            return copy.deepcopy(self.original, memo)
        return copied_forward(self.module, memo)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # The file names nothing of this package: loaded, the module's forward attribute is
        # its own method (or the script's forward).
        if self.original is not None:
            return (copy.copy, (self.original,))
        return (getattr, (self.module, "forward"))


def release_copies() -> None:
    """Take every untimed forward off its copy (the run ended: each copy is left as
    TorchScript wants it)."""
    for untimed in list(_COPIES):
        untimed.release()
