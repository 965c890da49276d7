"""Each rank's time in its model's forward, and the FLOPs of one training step.

Under DDP every rank's step lasts as long as the slowest one's (the others wait in the
gradients' all-reduce), so the time between steps cannot name a slow rank. The forward holds
no collective of DDP's (its buffers are broadcast before the wrapped module is called), so
its length is the rank's own compute: a slow GPU, a throttled node or a larger batch shows
there. It is timed with CUDA events on a GPU (read once done: nothing waits for the GPU)
and with the clock on a CPU.

The FLOPs are counted once, on the first training forward, by torch's own
``FlopCounterMode`` on a copy of the model whose weights are on the meta device: shapes
only, so it computes nothing, needs no memory, and leaves the model, its batch and every
random stream as they were.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from hpc_ddp.runtime.logs import get_logger


def on_meta(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters, buffers and tensors kept as attributes are on
    the meta device (and that shares none of its state: whatever its forward keeps on itself
    stays on the copy)."""
    memo: dict[int, Any] = {}
    for parameter in module.parameters():
        memo[id(parameter)] = nn.Parameter(
            torch.empty_like(parameter, device="meta"), requires_grad=parameter.requires_grad
        )
    for buffer in module.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    for part in module.modules():  # tensors kept as plain attributes (a cache of masks)
        for value in vars(part).values():
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                memo[id(value)] = torch.empty_like(value, device="meta")
    return copy.deepcopy(module, memo)


def training_flops(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """FLOPs of one forward and backward of ``module`` on these inputs (the gradients of
    every trainable parameter from the sum of the outputs that need one), counted by
    ``FlopCounterMode`` on the meta device. Raises what the model raises there (a forward
    that reads a tensor's values, such as ``.item()``, cannot run on shapes alone)."""
    from torch.utils.flop_counter import FlopCounterMode

    # A compiled model's own module: shapes on meta would make torch.compile compile anew.
    shapes = on_meta(getattr(module, "_orig_mod", module))
    meta_args, meta_kwargs = tree_map_only(
        torch.Tensor, lambda tensor: torch.empty_like(tensor, device="meta"), (args, kwargs)
    )
    with torch.random.fork_rng(devices=[]), FlopCounterMode(display=False) as counter:
        outputs = shapes(*meta_args, **meta_kwargs)
        needing = [
            leaf for leaf in tree_leaves(outputs)
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad
        ]  # fmt: skip
        trainable = [parameter for parameter in shapes.parameters() if parameter.requires_grad]
        if needing and trainable:
            total = torch.stack([leaf.sum() for leaf in needing]).sum()
            torch.autograd.grad(total, trainable, allow_unused=True)
    return int(counter.get_total_flops())


def flop_text(flops: float) -> str:
    """``flops`` with an SI prefix: 138.8 kFLOP, 1.21 TFLOP."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if flops >= scale:
            return f"{flops / scale:.4g} {prefix}FLOP"
    return f"{flops:.4g} FLOP"


class ForwardMeter:
    """This rank's seconds in the forward of the models it is attached to, since the last
    :meth:`take`; where asked, the training FLOPs per sample counted on the first training
    forward (:attr:`flops_per_sample`)."""

    def __init__(
        self,
        device: torch.device,
        count_flops: bool,
        samples_of: Callable[[Any], int | None],
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``samples_of`` finds the samples in a forward's ``(args, kwargs)`` (the FLOPs
        counted are divided by them)."""
        self._samples_of = samples_of
        self._cuda = device.type == "cuda"
        self._clock = clock or time.perf_counter
        self._to_count = count_flops
        #: Training FLOPs (forward and backward) per sample; None: not counted.
        self.flops_per_sample: float | None = None
        #: True once a model's forward is timed (a script's own DDP is not).
        self.attached = False
        self._seconds = 0.0
        self._started: float | None = None
        self._events: list[tuple[Any, Any]] = []  # CUDA (start, end) pairs not read yet
        self._depth = 0
        self._counting = False

    def attach(self, module: nn.Module) -> None:
        """Time ``module``'s forward from now on (hooks, kept for the module's life). The
        hooks are closures, so a copy of the module (``copy.deepcopy``) shares this meter."""

        def before(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._before(module, args, kwargs)

        def after(*_: Any) -> None:
            self._after()

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after, always_call=True)
        self.attached = True

    def _before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._counting:
            return
        if self._to_count and module.training and torch.is_grad_enabled():
            self._to_count = False
            self._count(module, args, kwargs)
        self._depth += 1
        if self._depth > 1:
            return
        if self._cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events.append((start, None))
        else:
            self._started = self._clock()

    def _after(self) -> None:
        if self._counting or self._depth == 0:
            return
        self._depth -= 1
        if self._depth:
            return
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events[-1] = (self._events[-1][0], end)
        elif self._started is not None:
            self._seconds += self._clock() - self._started
            self._started = None

    def take(self) -> float:
        """The seconds in forward since the last take (on a GPU: the forwards the GPU has
        finished; the others are read at a later take)."""
        if self._cuda:
            waiting = []
            for start, end in self._events:
                if end is not None and end.query():
                    self._seconds += start.elapsed_time(end) / 1000.0
                else:
                    waiting.append((start, end))
            self._events = waiting
        seconds, self._seconds = self._seconds, 0.0
        return seconds

    def _count(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        samples = self._samples_of((args, kwargs))
        started = time.perf_counter()
        self._counting = True
        try:
            flops = training_flops(module, args, kwargs)
        except Exception as error:  # the model's own code, run on shapes: any error it raises
            get_logger().info(
                "monitor: the model's FLOPs could not be counted on the meta device "
                f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}): "
                "no interval/tflops or MFU. HINT: set monitor.flops_per_sample (about 6 x "
                "parameters x tokens per sample for a transformer)"
            )
            return
        finally:
            self._counting = False
        if not flops or not samples:
            get_logger().info(
                "monitor: no FLOPs counted in the model's forward and backward (or no batch "
                "size in its inputs): no interval/tflops or MFU. HINT: set "
                "monitor.flops_per_sample"
            )
            return
        self.flops_per_sample = flops / samples
        get_logger().info(
            f"monitor: one sample's forward and backward is {flop_text(flops / samples)} "
            f"(counted on the meta device from the first training batch of {samples}, "
            f"in {time.perf_counter() - started:.2f} s); monitor.flops_per_sample overrides it"
        )
