"""Whether a model or an optimizer holds tensors sharded over the ranks (DTensors, as FSDP2's
``fully_shard`` leaves a model's parameters), whoever sharded it: ``run.wrap`` under
``dist.strategy=fsdp``, or the user's own ``fully_shard`` calls.

Answered without importing ``torch.distributed.tensor`` or ``torch.distributed.fsdp`` (most
of a second): while nothing has imported them, no tensor can be a DTensor and no module
sharded.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
from torch import nn


def is_sharded_tensor(value: object) -> bool:
    """``value`` is a DTensor (each rank holds only its part of it)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def any_sharded(tensors: Iterable[object]) -> bool:
    return any(is_sharded_tensor(tensor) for tensor in tensors)


def sharded_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` (itself included) that ``fully_shard`` sharded."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return []
    return [module for module in model.modules() if isinstance(module, fsdp.FSDPModule)]


def innermost_sharded_blocks(model: nn.Module) -> list[nn.Module]:
    """The sharded blocks of ``model`` that hold no other sharded block (the model itself
    where it is the only one)."""
    blocks = sharded_blocks(model)
    inner = {id(block) for block in blocks}
    return [
        block
        for block in blocks
        if not any(id(module) in inner for module in block.modules() if module is not block)
    ]


def holds_shards(value: object) -> bool:
    """A module sharded by ``fully_shard`` (itself or a submodule: after a forward pass
    without backward, an evaluation, the root's parameters are whole tensors until the next
    reshard) or with a sharded parameter, or an optimizer updating one."""
    if isinstance(value, nn.Module):
        return bool(sharded_blocks(value)) or any_sharded(value.parameters())
    if isinstance(value, torch.optim.Optimizer):
        return any_sharded(param for group in value.param_groups for param in group["params"])
    return False
