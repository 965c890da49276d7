"""Sharded data parallel with FSDP2 (``torch.distributed.fsdp.fully_shard``): each rank
holds 1/W of the parameters, gradients and optimizer state. The blocks are sharded one by
one, then the whole model, so a block's parameters are gathered only while it runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from hpc_ddp.runtime.errors import HpcDdpError

#: Block names shown when one asked for is not in the model.
NAMES_SHOWN = 8


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """Each child of every ModuleList (a transformer's layers), outermost lists first."""
    blocks: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            blocks += [child for child in module if not any(child is b for b in blocks)]
    return blocks


def named_blocks(model: nn.Module, names: Sequence[str]) -> list[nn.Module]:
    """The submodules ``names`` names: a dotted path (``layers.0``) or a class name (every
    module of that class). A name that matches nothing is refused, with names that would."""
    by_path = dict(model.named_modules())
    blocks: list[nn.Module] = []
    for name in names:
        found = [by_path[name]] if name in by_path and name else []
        found += [module for module in model.modules() if type(module).__name__ == name]
        if not found:
            classes = sorted({type(module).__name__ for module in model.modules()})
            paths = [path for path in by_path if path][:NAMES_SHOWN]
            raise HpcDdpError(
                f"dist.shard_blocks names {name!r}, which is neither a submodule nor a class "
                f"of the model (submodules: {', '.join(paths)}; classes: "
                f"{', '.join(classes[:NAMES_SHOWN])})",
                "name blocks as model.named_modules() or their class names show them, or "
                "leave dist.shard_blocks out to shard each child of every ModuleList",
            )
        blocks += [module for module in found if not any(module is b for b in blocks)]
    return [block for block in blocks if block is not model]


def precision_policy(device: torch.device, setting: str) -> MixedPrecisionPolicy:
    """bf16 parameters in forward and backward where asked (auto: on GPU), fp32 reductions."""
    if setting == "bf16" or (setting == "auto" and device.type == "cuda"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_model(
    model: nn.Module, device: torch.device, blocks: Sequence[str] | None, precision: str
) -> nn.Module:
    """``model`` on ``device``, sharded over every rank (a collective). Inner blocks are
    sharded before the blocks that hold them: a block sharded first would make its inner
    blocks' parameters look tensor-parallel to fully_shard. A model on the meta device stays
    there, sharded (see :mod:`hpc_ddp.runtime.session.meta`)."""
    chosen = default_blocks(model) if blocks is None else named_blocks(model, blocks)
    depth = {id(module): name.count(".") for name, module in model.named_modules()}
    chosen.sort(key=lambda block: -depth[id(block)])
    if not any(parameter.is_meta for parameter in model.parameters()):
        model = model.to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = precision_policy(device, precision)
    for block in chosen:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


@contextlib.contextmanager
def accumulating(blocks: Sequence[nn.Module]) -> Iterator[None]:
    """A micro-step of gradient accumulation: no reduce-scatter and no resharding after
    backward (the gathered parameters are used again at once), in each of a model's sharded
    ``blocks`` (:func:`hpc_ddp.runtime.shards.sharded_blocks`: its root need not be one)."""
    sharded = [block for block in blocks if isinstance(block, FSDPModule)]
    for block in sharded:
        block.set_requires_gradient_sync(False, recurse=False)
        block.set_reshard_after_backward(False, recurse=False)
    try:
        yield
    finally:
        for block in sharded:
            block.set_requires_gradient_sync(True, recurse=False)
            block.set_reshard_after_backward(True, recurse=False)


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict of a sharded model on rank 0's CPU ({} elsewhere; a collective)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    return {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for replicated and sharded parameters alike: the
    norm of a sharded gradient is over all its shards (a collective), the same number on
    every rank; returns it as a plain tensor."""
    kept = list(parameters)
    gradients = [parameter.grad for parameter in kept if parameter.grad is not None]
    total: Any = torch.nn.utils.get_total_norm(gradients, norm_type)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(kept, max_norm, total)
    return total  # type: ignore[no-any-return]
