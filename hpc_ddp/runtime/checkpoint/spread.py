"""Which rank writes each replicated tensor of a folder save.

Under DDP every rank holds the same tensors. DCP would write each of them once anyway, but
a background save first copies what it is handed: given the whole state, every rank would
copy all of it (its time blocks training, its buffers stay in host memory) to write 1/W of
it. So each rank hands DCP only the replicated tensors it writes, chosen here the same way
on every rank: largest first, each to the rank with the fewest bytes so far. Sharded
tensors (FSDP2's DTensors) and small non-tensor values are left as they are.

The choice holds only when every rank holds the same replicated tensors; the caller checks
that (:func:`layout_of` on every rank) before it hands DCP a share.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterator, Mapping
from typing import Any

import torch

#: A tensor's place in a nested state dict: the keys leading to it.
Path = tuple[str, ...]


def replicated_tensors(state: Mapping[str, Any], at: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every plain tensor in the nested dicts of ``state`` (DTensors are sharded, not
    replicated), with its path."""
    from torch.distributed.tensor import DTensor

    for key, value in state.items():
        path = (*at, str(key))
        if isinstance(value, Mapping):
            yield from replicated_tensors(value, path)
        elif isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            yield path, value


def layout_of(state: Mapping[str, Any]) -> int:
    """A digest of the replicated tensors' paths, shapes and types (63 bits, so that ranks
    compare it in one small all-reduce): equal on every rank exactly when the ranks can
    split them with :func:`writers`."""
    digest = hashlib.sha256()
    for path, tensor in sorted(replicated_tensors(state), key=lambda item: item[0]):
        digest.update(repr((path, tuple(tensor.shape), str(tensor.dtype))).encode())
    return int.from_bytes(digest.digest()[:8], "big") >> 1


def writers(sizes: Mapping[Path, int], world_size: int) -> dict[Path, int]:
    """The rank that writes each tensor (``sizes``: bytes by path): largest first, each to
    the rank with the fewest bytes so far (the lowest such rank)."""
    loads = [(0, rank) for rank in range(world_size)]  # a heap: (bytes so far, rank)
    chosen: dict[Path, int] = {}
    for path, size in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        load, rank = loads[0]
        chosen[path] = rank
        heapq.heapreplace(loads, (load + size, rank))
    return chosen


def own_share(state: Mapping[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """``state`` without the replicated tensors other ranks write (a new dict; ``state`` is
    not changed)."""
    sizes = {
        path: tensor.numel() * tensor.element_size() for path, tensor in replicated_tensors(state)
    }
    others = {path for path, writer in writers(sizes, world_size).items() if writer != rank}
    return _without(state, others, ())


def _without(state: Mapping[str, Any], dropped: set[Path], at: Path) -> dict[str, Any]:
    kept: dict[str, Any] = {}
    for key, value in state.items():
        path = (*at, str(key))
        if isinstance(value, Mapping):
            kept[key] = _without(value, dropped, path)
        elif path not in dropped:
            kept[key] = value
    return kept
