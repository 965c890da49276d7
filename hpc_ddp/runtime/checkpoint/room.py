"""Whether the run directory's file system has room for the checkpoints a run keeps, checked
before the first step from the registered objects (a full disk found at the first save has
already cost the steps before it), and again with the first checkpoint's measured size."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from hpc_ddp.runtime.checkpoint.files import checkpoint_dir, list_checkpoints
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.place.dist import broadcast_object

#: Tensors per parameter an optimizer holds once it has stepped (Adam's two moments).
_MOMENTS = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1}


def _tensor_bytes(values: Iterable[Any], seen: set[Any] | None = None) -> int:
    """Bytes of the tensors in a state_dict's (nested) values, a storage shared by several
    (tied weights) once; a DTensor's whole size."""
    seen = set() if seen is None else seen
    total = 0
    for value in values:
        if isinstance(value, torch.Tensor):
            where = _storage_of(value)
            if where is None or where not in seen:
                total += value.numel() * value.element_size()
                seen.add(where)
        elif isinstance(value, Mapping):
            total += _tensor_bytes(value.values(), seen)
        elif isinstance(value, list | tuple):
            total += _tensor_bytes(value, seen)
    return total


def _storage_of(tensor: torch.Tensor) -> tuple[int, int, int] | None:
    """Where a plain tensor's bytes are (None: no address to compare, a meta tensor or a
    DTensor, each counted)."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.is_meta:
        return None
    address = tensor.untyped_storage().data_ptr()
    return (address, int(tensor.storage_offset()), tensor.numel()) if address else None


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


def checkpoints_to_come(keep_last: int, kept: int) -> int:
    """How many more checkpoints the disk must hold at once: keep_last + 1 (the newest is
    written before the oldest goes), less those a resumed run already keeps there."""
    return max(1, keep_last + 1 - kept)


def room_refusal(
    run_dir: Path, each: int, count: int, free: int, kept: int = 0
) -> HpcDdpError | None:
    """A refusal when ``free`` bytes cannot hold ``count`` more checkpoints of ``each``
    bytes (``kept``: those already there)."""
    needed = each * count
    if free >= needed:
        return None
    already = f", {kept} already kept there" if kept else ""
    return HpcDdpError(
        f"the file system of {run_dir} has {_size(free)} free; {count} more checkpoint(s) of "
        f"about {_size(each)} each (checkpoint.keep_last + 1 at once{already}; the registered "
        f"objects, an optimizer's state as it will be after its first step) need "
        f"{_size(needed)}",
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
        kept = len(list_checkpoints(checkpoint_dir(run_dir)))
        count = checkpoints_to_come(keep_last, kept)
        stat = os.statvfs(run_dir)
        error = room_refusal(run_dir, each, count, stat.f_bavail * stat.f_frsize, kept)
        refusal = (error.message, error.hint) if error else None
        if error is None:
            get_logger().info(
                f"room for {count} more checkpoint(s) of about {_size(each)}: "
                f"{_size(stat.f_bavail * stat.f_frsize)} free"
            )
    refusal = broadcast_object(refusal, group)
    if refusal is not None:
        raise HpcDdpError(*refusal)


def room_warning(name: str, each: int, free: int, keep_last: int, kept: int) -> str | None:
    """A warning when ``free`` bytes cannot hold the checkpoints still to come at once, each
    of ``each`` bytes as checkpoint ``name`` measured (``kept``: those now on disk)."""
    count = checkpoints_to_come(keep_last, kept)
    if free >= each * count:
        return None
    return (
        f"checkpoint {name} measured {_size(each)} on disk; the file system has {_size(free)} "
        f"free, and the {count} checkpoint(s) to come at once (checkpoint.keep_last + 1, "
        f"{kept} kept now) need {_size(each * count)}: a later save will fail. HINT: free "
        "space there, keep fewer checkpoints (checkpoint.keep_last), or set run.output_dir on a "
        "larger file system"
    )


def measure_room(folder: Path, keep_last: int) -> None:
    """After a run's first checkpoint folder: its size on disk against the free space (rank
    0's; says so once when the checkpoints to come will not fit)."""
    each = sum(entry.stat().st_size for entry in os.scandir(folder) if entry.is_file())
    stat = os.statvfs(folder)
    kept = len(list_checkpoints(folder.parent))
    warning = room_warning(folder.name, each, stat.f_bavail * stat.f_frsize, keep_last, kept)
    if warning is not None:
        get_logger().warning(warning)
