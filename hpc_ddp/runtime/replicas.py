"""Are the model replicas still equal? Exact weight fingerprints compared across ranks.

DDP keeps replicas equal only while every rank applies the same update; a checkpoint holds
rank 0's weights alone, so a divergence must be named, not hidden.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpc_ddp.runtime.dist import several_ranks


def weights_sha256(model: nn.Module) -> str:
    """A fingerprint of the state_dict: names, dtypes, shapes and bytes, in sorted order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        value = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}".encode())
        digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


def replica_fingerprint(model: nn.Module) -> torch.Tensor:
    """One exact integer per state_dict entry: the sum of its bits, on the CPU.

    Integer sums are order-independent, so equal tensors give equal numbers whatever the
    device or thread count, and a change of one bit in one element changes its number."""
    sums = []
    for tensor in model.state_dict().values():
        flat = tensor.detach().contiguous().view(-1)
        if flat.numel() == 0:
            sums.append(torch.zeros((), dtype=torch.int64, device=flat.device))
            continue
        as_bits = flat.view(torch.int32) if flat.element_size() == 4 else flat.view(torch.uint8)
        sums.append(as_bits.sum(dtype=torch.int64))
    if not sums:
        return torch.zeros(0, dtype=torch.int64)
    if len({value.device for value in sums}) > 1:  # a module spread over several devices
        sums = [value.cpu() for value in sums]
    return torch.stack(sums).cpu()


def diverged_replicas(
    model: nn.Module, world_size: int, group: Any | None
) -> list[tuple[int, str]]:
    """(rank, first differing state_dict entry) for every rank whose weights differ from rank
    0's; empty when all replicas are equal (a collective every rank must call)."""
    if world_size == 1 or not several_ranks():
        return []
    mine = replica_fingerprint(model)
    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine, group=group)
    names = list(model.state_dict())
    diverged = []
    for rank, theirs in enumerate(every[1:], start=1):
        differs = (theirs != every[0]).nonzero()
        if len(differs):
            diverged.append((rank, names[int(differs[0])]))
    return diverged
