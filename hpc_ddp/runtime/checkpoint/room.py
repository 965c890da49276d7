"""Whether the run directory's file system has room for the checkpoints a run keeps, checked
before the first step from the registered objects (a full disk found at the first save has
already cost the steps before it)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.place.dist import broadcast_object

#: Tensors per parameter an optimizer holds once it has stepped (Adam's two moments).
_MOMENTS = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1}


def _tensor_bytes(values: Iterable[Any]) -> int:
    """Bytes of the tensors in a state_dict's (nested) values; a DTensor's whole size."""
    total = 0
    for value in values:
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, Mapping):
            total += _tensor_bytes(value.values())
        elif isinstance(value, list | tuple):
            total += _tensor_bytes(value)
    return total


def _moments(optimizer: torch.optim.Optimizer) -> int:
    """Tensors per parameter ``optimizer`` will hold after its first step."""
    name, defaults = type(optimizer).__name__, optimizer.defaults
    if name in _MOMENTS:
        return _MOMENTS[name]
    if name == "SGD":
        return 1 if defaults.get("momentum") else 0
    if name == "RMSprop":
        return 1 + bool(defaults.get("momentum")) + bool(defaults.get("centered"))
    return 2  # an optimizer we do not know: as Adam, the common case


def estimated_checkpoint_bytes(objects: Mapping[str, Any]) -> int:
    """Bytes one checkpoint of the registered ``objects`` will hold: the tensors of their
    state now and, for an optimizer that has not stepped yet, the state it will hold."""
    total = 0
    for value in objects.values():
        if not hasattr(value, "state_dict"):
            continue
        if isinstance(value, torch.optim.Optimizer) and not value.state:
            parameters = [p for group in value.param_groups for p in group["params"]]
            total += _moments(value) * _tensor_bytes(parameters)
            continue
        total += _tensor_bytes(value.state_dict().values())
    return total


def _size(count: int | float) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 1e8 else f"{count / 1e6:.1f} MB"


def room_refusal(run_dir: Path, each: int, count: int, free: int) -> HpcDdpError | None:
    """A refusal when ``free`` bytes cannot hold ``count`` checkpoints of ``each`` bytes."""
    needed = each * count
    if free >= needed:
        return None
    return HpcDdpError(
        f"the file system of {run_dir} has {_size(free)} free; checkpoint.keep_last + 1 = "
        f"{count} checkpoints of about {_size(each)} each (the registered objects, an "
        f"optimizer's state as it will be after its first step) need {_size(needed)}",
        "free space there, keep fewer checkpoints (checkpoint.keep_last), or set "
        "run.output_dir on a larger file system; checks.enabled=false skips the check",
    )


def check_room(
    run_dir: Path, objects: Mapping[str, Any], keep_last: int, is_main: bool, group: Any | None
) -> None:
    """Refuse, on every rank, a run whose checkpoints would not fit: rank 0 estimates them
    and reads the free space, the others take its word (a collective)."""
    refusal = None
    if is_main:
        each = estimated_checkpoint_bytes(objects)
        stat = os.statvfs(run_dir)
        error = room_refusal(run_dir, each, keep_last + 1, stat.f_bavail * stat.f_frsize)
        refusal = (error.message, error.hint) if error else None
        if error is None:
            get_logger().info(
                f"room for {keep_last + 1} checkpoints of about {_size(each)}: "
                f"{_size(stat.f_bavail * stat.f_frsize)} free"
            )
    refusal = broadcast_object(refusal, group)
    if refusal is not None:
        raise HpcDdpError(*refusal)
