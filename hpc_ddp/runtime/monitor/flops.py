"""The FLOPs of one training forward and its backward, counted by torch's own
``FlopCounterMode`` on a copy of the model whose tensors are on the meta device: shapes only,
so nothing is computed and no memory is taken, and the model, its inputs, the hooks on it
and every random stream (Python's, NumPy's, torch's on the CPU and on the rank's GPU) are as
they were after the count."""

from __future__ import annotations

import copy
import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.monitor.throughput import ComputeDtype

#: The hook tables of a module that are walked on the copy: hooks of torch's own (old-style
#: weight_norm's, for one) are part of the model and stay; others (a script's, this
#: package's) would see meta tensors, so the copy has none of them.
HOOK_TABLES = (
    "_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
    "_state_dict_hooks", "_load_state_dict_pre_hooks",
)  # fmt: skip

MapTensors = Callable[[Any, Callable[[torch.Tensor], torch.Tensor]], Any]


def _meta_twin(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(
            torch.empty_like(tensor, device="meta"), requires_grad=tensor.requires_grad
        )
    twin = torch.empty_like(tensor, device="meta")
    return twin.requires_grad_() if tensor.requires_grad and twin.is_floating_point() else twin


def on_meta(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters, buffers and every tensor it keeps (in
    attributes, lists, dicts) are on the meta device, without a script's hooks; it shares
    none of the module's state, so whatever its forward keeps on itself stays on the copy.
    (A tensor inside an object of the script's own class is copied where it is.)"""
    memo: dict[int, Any] = {}
    for part in module.modules():
        for name, value in vars(part).items():
            if name == "_modules":
                continue
            for leaf in tree_leaves(value):
                if isinstance(leaf, torch.Tensor) and id(leaf) not in memo:
                    memo[id(leaf)] = _meta_twin(leaf)
        for table in HOOK_TABLES:  # dropped hooks are not copied (nor what they are bound to)
            for hook in getattr(part, table, {}).values():
                if not is_torchs_own(hook):
                    memo[id(hook)] = None
    twin = copy.deepcopy(module, memo)
    for part in twin.modules():
        for table in HOOK_TABLES:
            hooks = getattr(part, table, {})
            for key in [key for key, hook in hooks.items() if hook is None]:
                del hooks[key]
    return twin


def is_torchs_own(hook: object) -> bool:
    """A hook that torch itself put on a module (old-style weight_norm's), not a script's or
    another package's."""
    home = str(getattr(hook, "__module__", "") or "")
    return home == "torch" or home.startswith("torch.")


@contextmanager
def streams_kept(device: torch.device) -> Iterator[None]:
    """Every random stream a forward may draw from, put back as it was on leaving."""
    python = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    cuda = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        random.setstate(python)
        if numpy is not None:
            numpy.random.set_state(numpy_state)


def training_flops(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    map_tensors: MapTensors,
    device: torch.device,
) -> int:
    """FLOPs of one forward of ``module`` on these inputs (``map_tensors`` walks them) and
    the backward from the sum of its outputs that need a gradient, counted on the meta
    device. Raises what the model raises there (a forward that reads a tensor's values, such
    as ``.item()``, cannot run on shapes alone)."""
    from torch.utils.flop_counter import FlopCounterMode

    # A compiled model's own module: shapes on meta would make torch.compile compile anew.
    shapes = on_meta(getattr(module, "_orig_mod", module))
    meta_inputs = map_tensors((args, kwargs), _meta_twin)
    with streams_kept(device), FlopCounterMode(display=False) as counter:
        outputs = shapes(*meta_inputs[0], **meta_inputs[1])
        needing = [
            leaf for leaf in tree_leaves(outputs)
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad
        ]  # fmt: skip
        if needing:
            # .backward() on the throwaway copy: unlike autograd.grad it takes parametrized
            # weights and reentrant activation checkpointing.
            torch.stack([leaf.sum() for leaf in needing]).sum().backward()
    return int(counter.get_total_flops())


def compute_dtype(
    autocast_dtype: torch.dtype | None, parameter_dtype: torch.dtype | None, tf32: bool
) -> ComputeDtype | None:
    """The format a forward's matrix multiplies run in: autocast's where it is on
    (``autocast_dtype``), else the parameters' (fp32 as TF32 where ``tf32`` allows it);
    None where neither says (no floating-point parameter, or a format not in the table)."""
    formats: dict[torch.dtype, ComputeDtype] = {
        torch.bfloat16: "bf16", torch.float16: "fp16",
        torch.float32: "tf32" if tf32 else "fp32",
    }  # fmt: skip
    chosen = autocast_dtype if autocast_dtype is not None else parameter_dtype
    return formats.get(chosen) if chosen is not None else None


def dtype_in_use(module: nn.Module, device_type: str) -> ComputeDtype | None:
    """:func:`compute_dtype` of a forward of ``module`` starting now on ``device_type``:
    autocast as the script has set it around the forward, the first floating-point
    parameter, and whether its fp32 matrix multiplies (or, for a model with convolutions,
    cuDNN's) may use TF32. None where torch cannot say (an older torch): the MFU then
    assumes bf16, and the forward is never the worse for asking."""
    try:
        autocast = (
            torch.get_autocast_dtype(device_type)
            if torch.is_autocast_enabled(device_type)
            else None
        )
        parameter = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
        tf32 = device_type == "cuda" and (
            _tf32_allowed(torch.backends.cuda.matmul)
            or (_has_convolutions(module) and _tf32_allowed(torch.backends.cudnn.conv))  # type: ignore[attr-defined]
        )
    except (AttributeError, RuntimeError, TypeError):
        return None
    return compute_dtype(autocast, parameter, tf32)


def _tf32_allowed(backend: Any) -> bool:
    """Whether a backend (``torch.backends.cuda.matmul``, ``torch.backends.cudnn.conv``)
    may compute fp32 as TF32: its ``fp32_precision`` (torch 2.9 and later; "none" leaves it
    to the older switch), else ``allow_tf32`` (which raises once the new one is set)."""
    precision = getattr(backend, "fp32_precision", "none")
    if precision != "none":
        return bool(precision == "tf32")
    if backend is torch.backends.cuda.matmul:
        return torch.get_float32_matmul_precision() != "highest"
    return bool(torch.backends.cudnn.allow_tf32)


def _has_convolutions(module: nn.Module) -> bool:
    return any(isinstance(part, nn.modules.conv._ConvNd) for part in module.modules())


def flop_text(flops: float) -> str:
    """``flops`` with an SI prefix: 138.8 kFLOP, 1.21 TFLOP."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if flops >= scale:
            return f"{flops / scale:.4g} {prefix}FLOP"
    return f"{flops:.4g} FLOP"


def logged_flops(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    map_tensors: MapTensors,
    device: torch.device,
) -> float | None:
    """:func:`training_flops`, said in the log (or why there is no count: None)."""
    started = time.perf_counter()
    name = type(module).__name__
    try:
        flops = training_flops(module, args, kwargs, map_tensors, device)
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
