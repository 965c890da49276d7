"""What a checkpoint holds of the user's objects: anything with ``state_dict()`` and
``load_state_dict()`` (torch's Stateful convention), and every rank's random streams."""

from __future__ import annotations

import io
import random
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_map

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.shards import holds_shards


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
        #: Objects of which each rank saves and restores its own copy.
        self.per_rank: dict[str, Any] = {}
        #: The DDP wrappers of registered modules, by name (their buffers are each rank's
        #: own between steps, see :mod:`.buffers`).
        self.wrappers: dict[str, DistributedDataParallel] = {}

    def add(self, objects: Mapping[str, object], per_rank: bool = False) -> None:
        """Register each object under its name (``per_rank``: each rank's own copy); a DDP
        wrapper is saved as its module, so the weights load into a plain module too."""
        target = self.per_rank if per_rank else self.objects
        for name, value in objects.items():
            if not _is_stateful(value):
                raise HpcDdpError(
                    f"cannot register {name}={type(value).__name__}: it has no state_dict() "
                    "and load_state_dict()",
                    "register objects that follow torch's Stateful convention (modules, "
                    "optimizers, schedulers, ...), or give your own object these two methods",
                )
            wrapper = value if isinstance(value, DistributedDataParallel) else None
            if wrapper is not None:
                value = wrapper.module
            if name in target and target[name] is not value:
                raise HpcDdpError(
                    f"the name {name!r} is already registered for another object",
                    "give every registered object its own name",
                )
            if name not in target and (name in self.objects or name in self.per_rank):
                how = "per rank" if name in self.per_rank else "with run.register()"
                raise HpcDdpError(
                    f"{name!r} is already registered {how}",
                    "register each object once: shared (run.register) or per rank "
                    "(run.register_per_rank)",
                )
            target[name] = value
            if wrapper is not None and not per_rank:
                self.wrappers[name] = wrapper
        check_optimizers_follow_shards(self.objects)

    def check_loadable(self) -> None:
        """Refuse an object whose state a resume could not load back (see
        :func:`check_loadable`), before any checkpoint of the run is written."""
        for name, value in {**self.objects, **self.per_rank}.items():
            check_loadable(f"the registered {name!r} ({type(value).__name__})", value.state_dict())

    def state_dicts(self) -> dict[str, Any]:
        return {name: value.state_dict() for name, value in self.objects.items()}

    def per_rank_states(self) -> dict[str, Any]:
        """This rank's own state of each object registered per rank, its tensors copied to
        the CPU (they travel to rank 0, or into this rank's own blob)."""
        states = {name: value.state_dict() for name, value in self.per_rank.items()}
        return tree_map(lambda leaf: leaf.cpu() if isinstance(leaf, torch.Tensor) else leaf, states)  # type: ignore[no-any-return]

    def restore(self, saved: Mapping[str, Any], path: Path) -> None:
        """Load every registered object from ``saved``; the names must match exactly."""
        self.check_names(list(saved), path)
        for name, value in self.objects.items():
            guarded_restore(name, path, value.load_state_dict, saved[name])

    def restore_per_rank(
        self, saved: Mapping[str, Any], path: Path, written_by: int, rank: int, world_size: int
    ) -> None:
        """Give each object registered per rank this rank's own state from checkpoint
        ``saved`` (written by ``written_by`` ranks); refused where the names differ or the
        number of ranks changed: such state cannot be split or merged."""
        names = sorted(saved.get("per_rank_names") or ())
        if names != sorted(self.per_rank):
            raise HpcDdpError(
                f"cannot resume from {path}: it holds {names or 'no objects'} per rank, this "
                f"run registered {sorted(self.per_rank) or 'none'} per rank",
                "register the same objects with run.register_per_rank() under the same names "
                "as the run that wrote the checkpoint, or start a fresh run with another run.id",
            )
        if not names:
            return
        if written_by != world_size:
            raise HpcDdpError(
                f"cannot resume {', '.join(names)} from {path}: each rank saved its own, and "
                f"the checkpoint holds {written_by} ranks' states, this run has {world_size}",
                f"resume on {written_by} ranks, or start a fresh run with another run.id "
                "(in which run.register() may take them where one copy, rank 0's, serves "
                "every rank)",
            )
        own = saved["per_rank"][rank]
        for name, value in self.per_rank.items():
            guarded_restore(name, path, value.load_state_dict, own[name])

    def check_names(self, saved: list[str], path: Path) -> None:
        """Refuse a checkpoint whose objects are not registered under the same names."""
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


def guarded_restore(what: str, path: Path, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, restoring ``what`` from checkpoint ``path``; its failure as an
    HpcDdpError that keeps torch's reason and says what to do."""
    try:
        return call(*args)
    except HpcDdpError:
        raise
    except Exception as error:
        reason, hint = describe_load_error(error)
        raise HpcDdpError(
            f"cannot restore {what!r} from {path}: {type(error).__name__}: {reason}", hint
        ) from None
    except BaseException as error:  # torch's CheckpointException: a file that does not read
        if isinstance(error, KeyboardInterrupt | SystemExit | GeneratorExit):
            raise
        reason = " ".join(str(error).split())[:300]
        raise HpcDdpError(
            f"cannot restore {what!r} from {path}: its files do not read "
            f"({type(error).__name__}: {reason})",
            "its files were whole when the run chose it (their sizes, and their checksums "
            "where kept), so the file system most likely failed this read: run again (a "
            f"requeued job does); if it fails again, move {path.name} into "
            f"{path.parent}/unreadable/ and the run goes on from the checkpoint before it",
        ) from None


#: Keys listed of each kind (missing, unexpected) when a state does not load.
KEYS_SHOWN = 6
_COMPILED_PREFIX = "_orig_mod."


def _keys_line(line: str) -> tuple[str, list[str]]:
    label, _, keys = line.partition(":")
    return label.strip(), [key.strip().strip('".') for key in keys.split(",") if key.strip()]


def describe_load_error(error: BaseException) -> tuple[str, str]:
    """Why ``load_state_dict`` refused a saved state, in one line that keeps torch's reason
    (the keys missing and unexpected, a few of each and their counts), and the HINT."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    hint = (
        "build the registered objects the same way as the run that wrote the checkpoint "
        "(same shapes and parameter groups), or start a fresh run with another run.id"
    )
    keyed = [line for line in lines if line.startswith(("Missing key", "Unexpected key"))]
    if not keyed:
        reasons = [line for line in lines[1:] if not line.startswith("Error(s)")]
        return "; ".join(line.rstrip(".") for line in reasons[:3] or lines[:1]), hint
    parts, every_key = [], []
    for line in keyed:
        label, keys = _keys_line(line)
        every_key += keys
        shown = ", ".join(keys[:KEYS_SHOWN]) + (" ..." if len(keys) > KEYS_SHOWN else "")
        parts.append(f"{label} ({len(keys)}): {shown}")
    if any(key.startswith(_COMPILED_PREFIX) for key in every_key):
        hint = (
            "one side is a torch.compile'd model (its keys start with _orig_mod.): register "
            "the model as it is before compiling it (run.register(model=model), then "
            "model = torch.compile(model)), in both runs"
        )
    return "; ".join(parts), hint


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


def restore_rng(state: Mapping[str, Any], device: torch.device) -> None:
    """Continue the random streams saved by :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    if isinstance(internal, torch.Tensor):
        internal = internal.tolist()
    random.setstate((version, tuple(internal), gauss))
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def _refusal(state: Any) -> str | None:
    """Why ``torch.load(weights_only=True)`` would refuse ``state``, or None; tensors are
    replaced by empty ones first, so only the structure is written."""
    skeleton = tree_map(
        lambda leaf: torch.empty(0) if isinstance(leaf, torch.Tensor) else leaf, state
    )
    buffer = io.BytesIO()
    try:
        torch.save(skeleton, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as error:  # pickling or safe loading refused it: both are the answer
        refused = re.search(r"GLOBAL (\S+) was not an allowed global", str(error))
        if refused:
            return f"it holds a {refused.group(1)}, which safe loading (weights_only) refuses"
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return None


def check_loadable(what: str, state: Any) -> None:
    """Raise when ``state`` could be saved but a resume could not load it safely
    (``weights_only=True`` allows tensors, numbers, strings, None and containers of them)."""
    why = _refusal(state)
    if why is not None:
        raise HpcDdpError(
            f"{what} has a state that a resume could not load back: {why}",
            "keep checkpointed state to tensors, numbers, strings, bools, None and "
            "lists/tuples/dicts of them (a numpy array: torch.from_numpy(array); a float64 "
            "scalar: float(value))",
        )


def check_optimizers_follow_shards(objects: Mapping[str, Any]) -> None:
    """Refuse an optimizer built before run.wrap sharded the model: it updates the
    parameters the model had then, which the sharded model no longer uses, so training
    would leave the model as it was, without a word."""
    sharded = [
        name
        for name, value in objects.items()
        if isinstance(value, nn.Module) and holds_shards(value)
    ]
    if not sharded:
        return
    used = {id(param) for name in sharded for param in objects[name].parameters()}
    for name, value in objects.items():
        if not isinstance(value, torch.optim.Optimizer) or holds_shards(value):
            continue
        params = [param for group in value.param_groups for param in group["params"]]
        if params and not any(id(param) in used for param in params):
            raise HpcDdpError(
                f"the optimizer {name!r} updates none of the parameters of the sharded model "
                f"{sharded[0]!r}: it was built before run.wrap sharded the model, whose "
                "parameters are new ones since, so training would leave the model as it was",
                "build the optimizer after `model = run.wrap(model)`, from model.parameters()",
            )
