"""What a checkpoint holds of the user's objects: anything with ``state_dict()`` and
``load_state_dict()`` (torch's Stateful convention), and every rank's random streams."""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch.nn.parallel import DistributedDataParallel

from hpc_ddp.runtime.dist import gather_object_to_main
from hpc_ddp.runtime.errors import HpcDdpError


@runtime_checkable
class Stateful(Protocol):
    """Torch's convention: an object whose state can be saved and restored."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


def _is_stateful(value: object) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


class Registry:
    """Named objects a checkpoint saves and a resume restores."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}

    def add(self, objects: Mapping[str, object]) -> None:
        """Register each object under its name; a DDP wrapper is saved as its module, so the
        weights load into a plain module too."""
        for name, value in objects.items():
            if not _is_stateful(value):
                raise HpcDdpError(
                    f"cannot register {name}={type(value).__name__}: it has no state_dict() "
                    "and load_state_dict()",
                    "register objects that follow torch's Stateful convention (modules, "
                    "optimizers, schedulers, ...), or give your own object these two methods",
                )
            if name in self.objects and self.objects[name] is not value:
                raise HpcDdpError(
                    f"the name {name!r} is already registered for another object",
                    "give every registered object its own name",
                )
            if isinstance(value, DistributedDataParallel):
                value = value.module
            self.objects[name] = value

    def state_dicts(self) -> dict[str, Any]:
        return {name: value.state_dict() for name, value in self.objects.items()}

    def restore(self, saved: Mapping[str, Any], path: Path) -> None:
        """Load every registered object from ``saved``; the names must match exactly."""
        missing = sorted(set(saved) - set(self.objects))
        extra = sorted(set(self.objects) - set(saved))
        if missing or extra:
            raise HpcDdpError(
                f"cannot resume from {path}: it holds {sorted(saved)}, this run registered "
                f"{sorted(self.objects)}"
                + (f" (not registered: {', '.join(missing)})" if missing else "")
                + (f" (not in the checkpoint: {', '.join(extra)})" if extra else ""),
                "register the same objects under the same names as the run that wrote the "
                "checkpoint, or start a fresh run with another run.id (or "
                "checkpoint.resume=false)",
            )
        for name, value in self.objects.items():
            try:
                value.load_state_dict(saved[name])
            except Exception as error:
                first = str(error).strip().splitlines()[0] if str(error).strip() else ""
                raise HpcDdpError(
                    f"cannot restore {name!r} from {path}: {type(error).__name__}: {first}",
                    "build the registered objects the same way as the run that wrote the "
                    "checkpoint (same shapes and parameter groups), or start a fresh run with "
                    "another run.id",
                ) from None


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random streams: torch (CPU and the rank's GPU) and Python's."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        # A tensor, not a list: a checkpoint loaded with mmap then reads only the rank's own
        # streams from disk, not all W ranks' (the list would be in the pickle every rank
        # unpickles).
        "python": [version, torch.tensor(internal, dtype=torch.int64), gauss],
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def gathered_rng_states(device: torch.device, group: Any | None) -> list[dict[str, Any]]:
    """Every rank's random streams, in rank order, on rank 0 ([] on the others; a
    collective)."""
    return gather_object_to_main(rng_state(device), group)


def restore_rng(state: Mapping[str, Any], device: torch.device) -> None:
    """Continue the random streams saved by :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    if isinstance(internal, torch.Tensor):
        internal = internal.tolist()
    random.setstate((version, tuple(internal), gauss))
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
