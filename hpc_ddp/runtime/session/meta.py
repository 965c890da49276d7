"""Models built on the meta device (shapes, no data), as FSDP2's examples and torchtitan build
a model larger than one host's memory: ``run.wrap`` shards it first under
``dist.strategy=fsdp`` and gives each rank storage for its own shards only, then initialises
them; under DDP every rank materialises the whole model."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import torch
from torch import nn

from hpc_ddp.runtime.errors import HpcDdpError

#: What initialises a materialised model's weights in place (under ``torch.no_grad``).
InitWeights = Callable[[nn.Module], object]
#: Modules and tensors named when several are refused.
NAMES_SHOWN = 5


def on_meta_device(model: nn.Module, init_weights: InitWeights | None) -> bool:
    """Whether ``model`` is on the meta device, so :func:`materialise` must give it storage;
    refuses a model partly there (``to_empty`` would wipe the weights that are not), an
    ``init_weights`` for a model that has its weights already or that is not callable, and a
    meta model holding what nothing would initialise (``init_weights`` not given)."""
    name = type(model).__name__
    if init_weights is not None and not callable(init_weights):
        raise HpcDdpError(
            f"run.wrap({name}, init_weights={init_weights!r}): init_weights is a "
            f"{type(init_weights).__name__}, expected a function of the model",
            "pass the function itself, e.g. init_weights=model_init (not model_init())",
        )
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    on_meta = [path for path, tensor in tensors.items() if tensor.is_meta]
    if not on_meta:
        if init_weights is not None:
            raise HpcDdpError(
                f"run.wrap({name}, init_weights=...): the model holds its weights already "
                "(none is on the meta device), so there is nothing to initialise",
                "leave init_weights out, or build the model under torch.device('meta')",
            )
        return False
    if len(on_meta) < len(tensors):
        holding = [path for path in tensors if path not in set(on_meta)]
        raise HpcDdpError(
            f"run.wrap({name}): {len(on_meta)} of its {len(tensors)} parameters and buffers "
            f"are on the meta device and the others ({shown(holding)}) hold data; "
            "materialising it would wipe them",
            "build the whole model under torch.device('meta'), or none of it",
        )
    if init_weights is None:
        check_reset_covers(model)
    return True


def check_reset_covers(model: nn.Module) -> None:
    """Refuses a meta model whose ``reset_parameters()`` methods would leave something
    uninitialised: a module holding parameters or buffers without one, or a buffer left out
    of the state dict (computed in ``__init__``, as rotary tables are, and rarely redone by
    ``reset_parameters``)."""
    name = type(model).__name__
    hint = (
        "pass run.wrap(model, init_weights=fn): fn(model) initialises every weight and buffer "
        "in place, as torchtitan's init_weights does; or build the model with data"
    )
    bare = [
        path or name
        for path, module in model.named_modules()
        if owns_tensors(module) and not callable(getattr(module, "reset_parameters", None))
    ]
    if bare:
        raise HpcDdpError(
            f"run.wrap({name}) on the meta device: {shown(bare)} "
            f"{'holds' if len(bare) == 1 else 'hold'} parameters or buffers but no "
            "reset_parameters(), so nothing would initialise them (they would hold "
            "whatever memory was there)",
            hint,
        )
    saved = set(model.state_dict())
    unsaved = [path for path, _ in model.named_buffers() if path not in saved]
    if unsaved:
        raise HpcDdpError(
            f"run.wrap({name}) on the meta device: the buffer(s) {shown(unsaved)} are not in "
            "the state dict (persistent=False), so they are computed when the model is "
            "built, which on the meta device computes nothing, and reset_parameters() "
            "need not redo it",
            hint,
        )


def owns_tensors(module: nn.Module) -> bool:
    """Whether ``module`` holds a parameter or buffer itself (not only through a child)."""
    return any(True for _ in [*module.parameters(False), *module.buffers(False)])


def shown(names: list[str]) -> str:
    """The first few of ``names``, with how many more there are."""
    more = len(names) - NAMES_SHOWN
    return ", ".join(names[:NAMES_SHOWN]) + (f" and {more} more" if more > 0 else "")


def materialise(model: nn.Module, device: torch.device, init_weights: InitWeights | None) -> None:
    """Storage on ``device`` for what this rank holds of ``model`` (of a sharded model, its
    shards only), initialised by ``init_weights(model)``, else by the ``reset_parameters()``
    of every module holding parameters or buffers itself, under ``torch.no_grad``. Every rank
    draws from the same seeded stream, so replicas start equal."""
    with parameters_kept(model):
        model.to_empty(device=device)
    with torch.no_grad():
        if init_weights is not None:
            init_weights(model)
            return
        for module in model.modules():
            if owns_tensors(module):
                module.reset_parameters()  # type: ignore[operator]


@contextlib.contextmanager
def parameters_kept(model: nn.Module) -> Iterator[None]:
    """``to_empty`` that gives each parameter storage in place, so a weight tied between two
    modules (an embedding and the output layer) stays one parameter; a sharded model's
    parameters are FSDP2's, which it moves itself."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        yield
        return
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def sharded_on_device(
    model: nn.Module,
    shard: Callable[[nn.Module], nn.Module],
    device: torch.device,
    init_weights: InitWeights | None,
    on_meta: bool,
) -> nn.Module:
    """``shard(model)``, with storage on ``device`` for this rank's shards when ``model`` is
    on the meta device, initialised by :func:`initialise_shards`, or by ``init_weights`` on
    the sharded model (DTensors). On a CPU mesh the script's ``init_weights`` would draw the
    same numbers for every rank's shard (DTensor keeps per-shard random offsets on GPUs
    only), so there the whole model is materialised for it first."""
    if not on_meta:
        return shard(model)
    if init_weights is not None and device.type == "cpu":
        materialise(model, device, init_weights)
        return shard(model)
    if init_weights is not None:
        sharded = shard(model)
        materialise(sharded, device, init_weights)
        return sharded
    blueprint = copy.deepcopy(model)
    sharded = shard(model)
    sharded.to_empty(device=device)
    initialise_shards(sharded, blueprint, device)
    return sharded


def initialise_shards(sharded: nn.Module, blueprint: nn.Module, device: torch.device) -> None:
    """This rank's shards of ``sharded`` (given storage by ``to_empty``) set as the model
    built whole would have them: module by module, in order, ``reset_parameters()`` runs on a
    whole copy of that module's own weights (in ``blueprint``, the unsharded model still on
    the meta device) and this rank's part is copied in. Every rank draws the same numbers,
    as for a model built whole, so the shards differ where they should on any device (DTensor's
    own random ops do on GPUs only), and a rank holds one module's weights more at most."""
    live = dict(sharded.named_modules())
    with torch.no_grad():
        for path, twin in blueprint.named_modules():
            if not owns_tensors(twin):
                continue
            twin.to_empty(device=device, recurse=False)
            twin.reset_parameters()
            target = live[path]
            for name, whole in [
                *twin.named_parameters(recurse=False),
                *twin.named_buffers(recurse=False),
            ]:
                place(getattr(target, name), whole)
            twin.to_empty(device="meta", recurse=False)


def place(destination: torch.Tensor, whole: torch.Tensor) -> None:
    """``whole`` into ``destination``: of a sharded parameter, this rank's part only, copied
    from a view of ``whole`` (a copy of the part would stay in the allocator's heap)."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    if not isinstance(destination, DTensor):
        destination.copy_(whole)
        return
    mesh, placements = destination.device_mesh, destination.placements
    if mesh.ndim == 1 and type(placements[0]) is Shard:  # FSDP2's: torch.chunk along dim
        dim = placements[0].dim
        parts = torch.chunk(whole, mesh.size(), dim=dim)
        index = mesh.get_local_rank()
        part = parts[index] if index < len(parts) else whole.narrow(dim, 0, 0)
        local = destination.to_local()
        if local.shape == part.shape:
            local.copy_(part)
            return
    destination.copy_(distribute_tensor(whole, mesh, placements, src_data_rank=None))
