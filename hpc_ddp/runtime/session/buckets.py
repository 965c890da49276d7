"""DDP's gradient buckets, laid out before the first step so every attempt of a run sums
gradients in the same order.

DDP all-reduces gradients in buckets, and each element's sum over the ranks runs in an
order set by its position in its bucket (a ring all-reduce sums each chunk starting at a
different rank). DDP builds its first buckets in parameter order and rebuilds them after the
first backward in the order the gradients became ready. A run resumed from a checkpoint
starts a new DDP, so its first step used the first layout while the uninterrupted run used
the rebuilt one: at three or more ranks the sums differ in the last bits and a resumed run
was no longer bitwise equal. Rebuilding right away, in reverse parameter order (the order a
backward pass produces gradients in a model used in the order it is defined, the order
DDP's own first layout assumes), gives every attempt the same buckets from its first step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.shards import holds_shards


def settle_buckets(model: DistributedDataParallel) -> bool:
    """Rebuild ``model``'s buckets now (a collective every rank must call, right after
    wrapping); False where DDP would not rebuild them anyway or cannot be driven."""
    if model.static_graph:
        if _first_of_its_group(model):
            get_logger().warning(
                "DistributedDataParallel(static_graph=True) lays out its gradient buckets "
                "after each attempt's first step, so a resumed run at 3 or more ranks may "
                "differ from an uninterrupted one in the last bits. HINT: leave static_graph "
                "out for bitwise resumes"
            )
        return False
    if model.find_unused_parameters:
        return False  # DDP never rebuilds its buckets then: every attempt keeps the first
    reducer = model.reducer
    try:
        parameters, sparse = model._build_params_for_reducer()
        if any(sparse):
            return False
        first = parameters[0].device
        reducer.prepare_for_forward()
        total = torch.zeros((), device=first)
        for parameter in parameters:  # the backward pass readies them in reverse
            total = total + (parameter.reshape(-1)[:1] * 0).sum().to(first)
        reducer.prepare_for_backward([])
        total.backward()
        for parameter in parameters:
            parameter.grad = None
        return bool(reducer._rebuild_buckets())
    except (AttributeError, RuntimeError, TypeError) as error:  # another torch's internals
        get_logger().warning(
            f"could not lay out DDP's buckets ahead of the first step ({error}); a resumed "
            "run at 3 or more ranks may differ from an uninterrupted one in the last bits"
        )
        return False


def _first_of_its_group(model: DistributedDataParallel) -> bool:
    """Whether this rank is the first of ``model``'s process group (it speaks for all)."""
    return torch.distributed.get_rank(model.process_group) == 0


def settle_own_ddp(objects: Mapping[str, Any], wrapped: Sequence[nn.Module]) -> None:
    """Lay out the buckets of every DistributedDataParallel in ``objects`` that the script
    built itself (not one in ``wrapped``, which :func:`wrap_in_ddp` settled): every rank
    registers the same objects, so this collective runs on all of them. One that has
    gradients already (registered after a backward) is left as it is: laying it out would
    drop them, and DDP has laid it out by then."""
    for value in objects.values():
        if not isinstance(value, DistributedDataParallel) or any(
            value.module is done for done in wrapped
        ):
            continue
        if any(parameter.grad is not None for parameter in value.parameters()):
            if _first_of_its_group(value):
                get_logger().warning(
                    "run.register got a DistributedDataParallel after its first backward: its "
                    "gradient buckets were laid out by that step, so a resumed run at 3 or more "
                    "ranks may differ from an uninterrupted one in the last bits. HINT: "
                    "register the model before training starts"
                )
            continue
        settle_buckets(value)


def check_wrappable(model: object, wrapped: Sequence[nn.Module]) -> None:
    """Refuse what DistributedDataParallel cannot take, or should not take again, in one line
    (torch would raise from deep inside, or wrap a model twice without a word)."""
    if isinstance(model, DistributedDataParallel) or any(model is done for done in wrapped):
        raise HpcDdpError(
            "run.wrap(model): this model is wrapped already",
            "wrap each model once and keep what run.wrap returned",
        )
    if not isinstance(model, nn.Module):
        raise HpcDdpError(
            f"run.wrap got a {type(model).__name__}, not a torch.nn.Module",
            "pass the model (an nn.Module) you train",
        )
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    if not trainable:
        raise HpcDdpError(
            f"run.wrap({type(model).__name__}): the model has no parameter that requires a "
            "gradient, so there is nothing for DDP to synchronise",
            "wrap the model you train (with its parameters); a frozen or parameter-free "
            "module needs no wrapping: move it to run.device",
        )
    if holds_shards(model):
        raise HpcDdpError(
            f"run.wrap({type(model).__name__}): the model is sharded already (its parameters "
            "are DTensors, as fully_shard leaves them)",
            "a model you shard yourself needs no wrapping: register it as it is "
            "(run.register(model=model)); or pass the plain model to run.wrap with "
            "dist.strategy=fsdp, which shards it",
        )


def check_shardable(ddp_options: Mapping[str, Any], save_mode: str) -> None:
    """Refuse what a sharded model cannot have: DDP's options, single-file checkpoints."""
    if ddp_options:
        raise HpcDdpError(
            f"run.wrap(model, {', '.join(ddp_options)}=...) with dist.strategy=fsdp: these are "
            "DistributedDataParallel's options",
            "leave them out under fsdp (dist.shard_blocks and dist.mixed_precision shape the "
            "sharding), or use dist.strategy=ddp",
        )
    check_not_single_file("dist.strategy=fsdp", save_mode)


def check_registrable(objects: Mapping[str, Any], save_mode: str | None) -> None:
    """Refuse registering sharded state (a model sharded with the user's own fully_shard,
    its optimizer) where checkpoints are single files (``save_mode``; None: no checkpoints)."""
    sharded = [name for name, value in objects.items() if holds_shards(value)]
    if sharded and save_mode is not None:
        check_not_single_file(f"run.register({sharded[0]}=...) of sharded state", save_mode)


def check_not_single_file(what: str, save_mode: str) -> None:
    """Refuse single-file checkpoints of sharded state (``what``): rank 0 holds only its
    own shards, so the file would hold a part of the model."""
    if save_mode == "single_file":
        raise HpcDdpError(
            f"{what} with checkpoint.save_mode=single_file: one rank cannot write a sharded "
            "model's state alone",
            "use checkpoint.save_mode=async (or sync): every rank writes its shards",
        )


def wrap_in_ddp(
    model: nn.Module, device: torch.device, ddp_options: Mapping[str, Any]
) -> DistributedDataParallel:
    """``model`` on ``device`` inside DDP, its buckets settled (a collective). A module already
    spread over several devices stays where it is and is wrapped without ``device_ids``."""
    devices = {tensor.device for tensor in [*model.parameters(), *model.buffers()]}
    if len(devices) > 1:
        wrapped = DistributedDataParallel(model, device_ids=None, **ddp_options)
    else:
        model = model.to(device)
        device_ids = [device.index] if device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids, **ddp_options)
    settle_buckets(wrapped)
    return wrapped
