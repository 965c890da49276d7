"""Are the model replicas still equal? Exact weight fingerprints compared across ranks.

DDP keeps replicas equal only while every rank applies the same update; a checkpoint holds
rank 0's weights alone, so a divergence must be named, not hidden.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpc_ddp.runtime.checkpoint.fingerprint import tensor_bytes
from hpc_ddp.runtime.place.dist import several_ranks


def weights_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """A fingerprint of a state dict: names, dtypes, shapes and bytes, in sorted order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(tensor_bytes(tensor))
    return digest.hexdigest()


def running_statistics(model: nn.Module) -> set[str]:
    """The state_dict names of normalisation layers' running statistics (BatchNorm's): each
    rank updates them from its own batches, so between steps they differ from rank to rank
    by design (DDP gives every rank rank 0's at its next forward). Such a layer says so
    with ``track_running_stats`` (BatchNorm, SyncBatchNorm, InstanceNorm)."""
    return {
        f"{module_name}.{name}".removeprefix(".")
        for module_name, module in model.named_modules()
        if hasattr(module, "track_running_stats")
        for name, _buffer in module.named_buffers(recurse=False)
    }


def replica_entries(model: nn.Module) -> dict[str, torch.Tensor]:
    """What must be equal on every rank: the state_dict less :func:`running_statistics`."""
    skipped = running_statistics(model)
    return {name: value for name, value in model.state_dict().items() if name not in skipped}


def replica_fingerprint(model: nn.Module) -> torch.Tensor:
    """One exact integer per :func:`replica_entries` entry: the sum of its bits, on the CPU.

    Integer sums are order-independent, so equal tensors give equal numbers whatever the
    device or thread count, and a change of one bit in one element changes its number."""
    sums = []
    for tensor in replica_entries(model).values():
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


@dataclass(frozen=True)
class Divergence:
    """Ranks whose weights differ from rank 0's: how many, and the lowest one's first entry."""

    ranks: int
    first_rank: int
    first_entry: str


def diverged_replicas(model: nn.Module, world_size: int, group: Any | None) -> Divergence | None:
    """Which ranks' weights differ from rank 0's (None: all replicas are equal); a collective
    every rank must call.

    Every message is the size of one fingerprint or smaller, whatever the world size: rank 0's
    fingerprint is broadcast, each rank compares its own, and two one-number all-reduces name
    how many differ and the lowest such rank with its first differing entry."""
    if world_size == 1 or not several_ranks():
        return None
    mine = replica_fingerprint(model)
    reference = mine.clone()
    dist.broadcast(reference, src=0, group=group)
    names = list(replica_entries(model))
    differs = (mine != reference).nonzero()
    rank = dist.get_rank(group)
    # rank * (entries + 1) + entry orders by rank first; a rank in sync sends the largest value.
    no_divergence = world_size * (len(names) + 1)
    first = torch.tensor(
        [rank * (len(names) + 1) + int(differs[0]) if len(differs) else no_divergence]
    )
    count = torch.tensor([1 if len(differs) else 0])
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    if int(count) == 0:
        return None
    first_rank, entry = divmod(int(first), len(names) + 1)
    return Divergence(int(count), first_rank, names[entry])


def divergence_message(diverged: Divergence, step: int) -> str:
    """The error line for replicas found to differ from rank 0's at ``step``."""
    others = f" and {diverged.ranks - 1} other rank(s)" if diverged.ranks > 1 else ""
    return (
        f"model replicas differ from rank 0's at step {step}: rank {diverged.first_rank} "
        f"({diverged.first_entry}){others}; checkpoints hold rank 0's weights. HINT: DDP "
        "keeps replicas equal only when every rank makes the same update: look for "
        "parameters or buffers changed outside the optimizer on some ranks only (in-place "
        "edits, rank-dependent branches, buffers not broadcast)"
    )
