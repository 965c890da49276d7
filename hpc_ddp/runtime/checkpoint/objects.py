"""The registered objects in a folder checkpoint: modules and optimizers as tensors that DCP
spreads over the ranks and reshards on load (through torch's ``get_state_dict`` family,
keyed by parameter names, so a DDP checkpoint loads into an FSDP2 run and back), every
other object's state dict as a plain value."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hpc_ddp.runtime.checkpoint.buffers import with_rank_zero_buffers
from hpc_ddp.runtime.checkpoint.sharded.layout import OBJECTS_KEY, FolderObjects
from hpc_ddp.runtime.checkpoint.sharded.metadata import read_metadata
from hpc_ddp.runtime.checkpoint.sharded.reading import load_objects
from hpc_ddp.runtime.checkpoint.state import guarded_restore
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.shards import holds_shards

MODULE, OPTIMIZER, PLAIN = "module", "optimizer", "plain"


def _owner(optimizer: torch.optim.Optimizer, objects: Mapping[str, Any]) -> str | None:
    """The registered module holding every parameter ``optimizer`` updates, if one does."""
    wanted = {id(param) for group in optimizer.param_groups for param in group["params"]}
    for name, value in objects.items():
        if isinstance(value, nn.Module) and wanted <= {id(p) for p in value.parameters()}:
            return name
    return None


def object_kinds(objects: Mapping[str, Any]) -> dict[str, str]:
    """How each registered object is saved. An optimizer that has not stepped yet is saved
    plain: torch's sharded form would first take a step with zero gradients to create its
    state, and that step changes Adam's step count."""
    _reshard(objects)
    kinds = {}
    for name, value in objects.items():
        if isinstance(value, nn.Module):
            kinds[name] = MODULE
        elif isinstance(value, torch.optim.Optimizer) and value.state and _owner(value, objects):
            kinds[name] = OPTIMIZER
        else:
            if isinstance(value, torch.optim.Optimizer) and value.state and holds_shards(value):
                raise HpcDdpError(
                    f"the registered optimizer {name!r} updates sharded parameters that no one "
                    "registered module holds all of: its state could be saved only as rank "
                    "0's shards",
                    "register the model whose parameters it updates (several models: one "
                    "nn.ModuleDict holding them, wrapped and registered as one)",
                )
            kinds[name] = PLAIN
    return kinds


def _reshard(objects: Mapping[str, Any]) -> None:
    """Put back the sharded parameters of every FSDP2 block: a forward pass without a
    backward (an evaluation) leaves the root's gathered, and a checkpoint, like the
    optimizer, must see the sharded ones."""
    from torch.distributed.fsdp import FSDPModule

    for value in objects.values():
        if isinstance(value, nn.Module):
            for module in value.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()


def _tensor_state(name: str, value: Any, kind: str, objects: Mapping[str, Any]) -> Any:
    # Imported here: torch.distributed.checkpoint takes most of a second to import.
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    if kind == MODULE:
        return get_model_state_dict(value)
    owner = _owner(value, objects)
    if owner is None:
        raise HpcDdpError(
            f"the registered optimizer {name!r} no longer updates parameters of a registered "
            "module",
            "register the model whose parameters the optimizer updates",
        )
    return get_optimizer_state_dict(objects[owner], value)


def tensor_states(
    objects: Mapping[str, Any],
    kinds: Mapping[str, str],
    wrappers: Mapping[str, DistributedDataParallel],
) -> dict[str, Any]:
    """The module and optimizer states DCP writes, by registered name (a collective: the
    buffers of a module that ``wrappers`` holds a DDP of are rank 0's, see :mod:`.buffers`)."""
    states = {}
    for name, value in objects.items():
        if kinds[name] == MODULE:
            state = _tensor_state(name, value, MODULE, objects)
            states[name] = with_rank_zero_buffers(wrappers.get(name), state)
        elif kinds[name] != PLAIN:
            states[name] = _tensor_state(name, value, kinds[name], objects)
    return states


def plain_states(objects: Mapping[str, Any], kinds: Mapping[str, str]) -> dict[str, Any]:
    return {name: value.state_dict() for name, value in objects.items() if kinds[name] == PLAIN}


def restore_objects(objects: Mapping[str, Any], saved: FolderObjects, path: Path) -> None:
    """Load every registered object from a folder checkpoint (the names are checked
    already). Optimizers get their state created first (a step with zero gradients and a
    zero learning rate), then the modules load, so that step leaves no trace."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    templates = {}
    for name, kind in saved.kinds.items():
        if kind != PLAIN:
            templates[name] = guarded_restore(
                name, path, _tensor_state, name, objects[name], kind, objects
            )
            if kind == OPTIMIZER:
                _only_saved_parameters(templates[name], name, saved.folder)
    guarded_restore("the registered objects", path, load_objects, saved.folder, templates)
    for name, kind in sorted(saved.kinds.items(), key=lambda item: item[1] != MODULE):
        value = objects[name]
        if kind == MODULE:
            guarded_restore(name, path, set_model_state_dict, value, templates[name])
        elif kind == OPTIMIZER:
            owner = objects[_owner(value, objects) or name]
            # Not strict: parameters that never had a gradient have no saved state.
            options = StateDictOptions(strict=False)
            load = functools.partial(set_optimizer_state_dict, options=options)
            guarded_restore(name, path, load, owner, value, templates[name])
        else:
            guarded_restore(name, path, value.load_state_dict, saved.plain[name])


def _only_saved_parameters(template: dict[str, Any], name: str, folder: Path) -> None:
    """Drop from an optimizer's template the parameters the checkpoint holds no state for
    (never given a gradient: an unused branch, an expert no token reached). Creating the
    state made some for every parameter; loaded without them, they have none again, as in
    the run that wrote the checkpoint."""
    prefix = f"{OBJECTS_KEY}.{name}.state."
    present: set[str] = set()  # every dotted head of a saved state key: the parameters with state
    for key in read_metadata(folder).state_dict_metadata:
        if key.startswith(prefix):
            parts = key.removeprefix(prefix).split(".")
            present.update(".".join(parts[:cut]) for cut in range(1, len(parts)))
    states = template.get("state", {})
    for parameter in list(states):
        if parameter not in present:
            del states[parameter]


def restore_whole_states(objects: Mapping[str, Any], saved: Mapping[str, Any], path: Path) -> None:
    """Load a single-file checkpoint, whose states are whole (written by a run that did not
    shard: DDP), into objects of which some are sharded (FSDP2): each rank puts its part of
    each whole tensor in place (the names are checked already)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    whole = StateDictOptions(full_state_dict=True)
    for name, value in objects.items():
        owner = _owner(value, objects) if isinstance(value, torch.optim.Optimizer) else None
        if isinstance(value, nn.Module) and holds_shards(value):
            load_module = functools.partial(set_model_state_dict, value, options=whole)
            guarded_restore(name, path, load_module, saved[name])
        elif owner is not None and holds_shards(value):
            module = objects[owner]
            state = _by_parameter_name(module, value, saved[name])
            load_optimizer = functools.partial(
                set_optimizer_state_dict, module, value, options=whole
            )
            guarded_restore(name, path, load_optimizer, state)
        else:
            guarded_restore(name, path, value.load_state_dict, saved[name])


def _by_parameter_name(
    module: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
) -> dict[str, Any]:
    """``optimizer.state_dict()`` as torch saves it (parameters numbered in the order of its
    groups) keyed by the parameters' names in ``module``, as torch's set_optimizer_state_dict
    takes it: the numbering is the same for the run that saved it, whose optimizer was built
    over the same parameters in the same order."""
    names = {id(param): name for name, param in module.named_parameters()}
    order = [names[id(param)] for group in optimizer.param_groups for param in group["params"]]
    return {
        "state": {order[index]: value for index, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [order[index] for index in group["params"]]}
            for group in state["param_groups"]
        ],
    }
