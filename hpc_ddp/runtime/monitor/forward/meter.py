"""This rank's forward meter: the models it times, their FLOPs, and what it hands each log
interval."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.monitor.flops import MapTensors, logged_flops
from hpc_ddp.runtime.monitor.forward.timed import (
    MOST_EVENTS,
    NOT_YET,
    ForwardTally,
    TimedForward,
    release_copies,
)
from hpc_ddp.runtime.monitor.throughput import ComputeDtype


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
        self._clock = clock or time.perf_counter
        self._counting = count_flops
        self._tally = ForwardTally()
        self._timed: list[TimedForward] = []
        self._said_compiled = False

    @property
    def attached(self) -> bool:
        """True while a model's forward is timed (a script's own DDP is not)."""
        return bool(self._timed)

    @property
    def compiled(self) -> bool:
        """True once a timed forward ran inside torch.compile's tracing: not timed."""
        return self._tally.compiled

    def attach(self, module: nn.Module, count_flops: bool = True) -> None:
        """Time ``module``'s training forwards until :meth:`detach`; ``count_flops`` False:
        never count its FLOPs (a sharded block, whose count would gather its parameters)."""
        timed = TimedForward(
            module,
            self._tally,
            self._clock,
            self._device.type == "cuda",
            functools.partial(logged_flops, map_tensors=self._map_tensors, device=self._device)
            if self._counting and count_flops
            else None,
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
        self._timed = []  # the meter keeps no model alive
        release_copies()

    @property
    def compute_dtype(self) -> ComputeDtype | None:
        """The format the first timed model's training forward ran in (autocast's, else its
        parameters'), for the MFU's peak; None before one ran."""
        return next((timed.dtype for timed in self._timed if timed.dtype), None)

    def flops_of(self, module: nn.Module) -> float | None:
        """The FLOPs counted for a training forward of ``module`` and its backward (None:
        not counted, or it could not be)."""
        for timed in self._timed:
            if timed.module is module and timed.flops is not NOT_YET:
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
