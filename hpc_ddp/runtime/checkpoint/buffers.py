"""A DDP model's buffers (BatchNorm's running statistics) in checkpoints.

Between steps each rank's buffers follow its own batches, and DDP gives every rank rank 0's
at its next synchronising forward. So a checkpoint keeps each rank's own (a resume on as
many ranks puts them back, exactly as the uninterrupted run holds them, for an evaluation
on the unwrapped model too) and, as the model's shared state, rank 0's (what a resume on
another number of ranks and an export get)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel


def broadcast_buffers(model: Any) -> list[tuple[str, torch.Tensor]]:
    """The buffers DDP broadcasts from rank 0 that a state dict holds (names as in
    ``model.module``); none for another model or a DDP with ``broadcast_buffers=False``."""
    if not isinstance(model, DistributedDataParallel) or not model.broadcast_buffers:
        return []
    ignored = set(getattr(model, "parameters_to_ignore", ()))
    persistent = set(model.module.state_dict())  # not a cache the module makes itself
    return [
        (name, buffer)
        for name, buffer in model.module.named_buffers()
        if name in persistent and name not in ignored and buffer.numel()
    ]


def with_rank_zero_buffers(
    model: DistributedDataParallel | None, state: dict[str, Any]
) -> dict[str, Any]:
    """``state`` (the state dict of ``model``'s module as DCP saves it: the live tensors;
    ``model`` None: not a DDP's, ``state`` as it is) with rank 0's
    copies of the buffers DDP broadcasts, found by storage (DCP's names drop wrappers'
    prefixes such as torch.compile's); a collective on ``model``'s group. The live buffers
    are left as they are."""
    live = {buffer.data_ptr() for _name, buffer in broadcast_buffers(model)}
    if model is None or not live or not torch.distributed.is_initialized():
        return state
    for key in sorted(state):
        value = state[key]
        if isinstance(value, torch.Tensor) and value.numel() and value.data_ptr() in live:
            copy = value.detach().clone()
            first = torch.distributed.get_global_rank(model.process_group, 0)
            torch.distributed.broadcast(copy, src=first, group=model.process_group)
            state[key] = copy
    return state


def own_buffers(
    wrappers: Mapping[str, DistributedDataParallel],
) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's copy of the buffers the registered DDPs (``wrappers``, by registered name)
    broadcast, on the CPU."""
    kept = {}
    for name, value in wrappers.items():
        buffers = broadcast_buffers(value)
        if buffers:
            kept[name] = {key: buffer.detach().cpu().clone() for key, buffer in buffers}
    return kept


def restore_own_buffers(
    wrappers: Mapping[str, DistributedDataParallel], saved: Any, rank: int
) -> None:
    """Put rank ``rank``'s saved buffers (``saved``: every rank's :func:`own_buffers`, as a
    checkpoint lists them; None in one written before they were kept) back into the live
    ones of the registered DDPs (``wrappers``)."""
    mine = saved[rank] if saved is not None else None
    for name, buffers in (mine or {}).items():
        model = wrappers.get(name)
        if model is None:
            continue
        live = dict(broadcast_buffers(model))
        with torch.no_grad():
            for key, value in buffers.items():
                if key in live and live[key].shape == value.shape:
                    live[key].copy_(value)
