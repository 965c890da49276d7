"""State a resume would get wrong: nothing registered (said before training), an optimizer
that steps a registered model unregistered (said at its first step), values of ``run.state``
that differ between the ranks (a checkpoint keeps rank 0's; said at a save), and objects
registered per rank under different names (refused at a save).

An optimizer is recognised by stepping, through torch's global optimizer step hook, not by
its absence from the registered objects: a script that updates its weights by hand (no
optimizer, as in a truncated-BPTT language model with a manual SGD step) has no optimizer
state to lose, and is told nothing."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hpc_ddp.runtime.checkpoint.state import Registry
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.place.dist import all_gather_object, same_on_all_ranks, several_ranks

#: What a resume would leave out when nothing is registered.
NOTHING_REGISTERED = (
    "nothing is registered for checkpoints: a resumed run could not restore its model. "
    "HINT: run.register(model=model, optimizer=optimizer) before training"
)


def holds(value: object, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``value`` is ``optimizer`` or keeps it as an attribute (an optimizer that
    wraps another, as ZeroRedundancyOptimizer does, or a script's own state object)."""
    return value is optimizer or any(
        item is optimizer for item in getattr(value, "__dict__", {}).values()
    )


def unregistered_optimizer_hint(
    registered: Mapping[str, object], optimizer: torch.optim.Optimizer
) -> str | None:
    """What a resume would get wrong when ``optimizer`` steps a registered model's
    parameters without being registered (None: it is, or it steps none of them)."""
    if any(holds(value, optimizer) for value in registered.values()):
        return None
    stepped = {id(parameter) for group in optimizer.param_groups for parameter in group["params"]}
    models = [
        name
        for name, value in registered.items()
        if isinstance(value, nn.Module)
        and any(id(parameter) in stepped for parameter in value.parameters())
    ]
    if not models:
        return None
    return (
        f"an optimizer ({type(optimizer).__name__}) steps the registered "
        f"{', '.join(models)} but is not registered: a resume restarts its state (momentum, "
        "Adam's moments, its step count) and goes on differently from an uninterrupted run. "
        "HINT: run.register(model=model, optimizer=optimizer, scheduler=...) with every "
        "object whose state training changes"
    )


def value_digest(value: Any) -> str:
    """A digest of a plain value (numbers, strings, tensors, and dicts, lists and tuples of
    them) that two ranks holding equal values compute alike: a tensor by its dtype, shape
    and bytes, anything else by its repr."""
    digest = hashlib.sha256()

    def feed(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            flat = item.detach().cpu().contiguous().reshape(-1)
            digest.update(f"tensor {flat.dtype} {tuple(item.shape)}:".encode())
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        elif isinstance(item, Mapping):
            digest.update(b"{")
            for key in sorted(item, key=repr):
                feed(key)
                feed(item[key])
            digest.update(b"}")
        elif isinstance(item, list | tuple):
            digest.update(b"[")
            for part in item:
                feed(part)
            digest.update(b"]")
        else:
            digest.update(repr(item).encode())

    feed(value)
    return digest.hexdigest()


def rank_differences(every: list[tuple[list[str], dict[str, str]]]) -> tuple[str, list[str]]:
    """From each rank's (names registered per rank, digest of each ``run.state`` value): the
    ranks' names listed where they differ ("" where alike), and the ``run.state`` keys whose
    values differ from rank 0's."""
    names = [theirs for theirs, _ in every]
    listed = ""
    if any(theirs != names[0] for theirs in names):
        listed = "; ".join(
            f"rank {rank}: {', '.join(theirs) or 'none'}" for rank, theirs in enumerate(names)
        )
    first = every[0][1]
    keys = {key for _, digests in every for key in digests}
    differing = sorted(key for key in keys if any(d.get(key) != first.get(key) for _, d in every))
    return listed, differing


class RegistrationWatch:
    """Says through ``say`` when nothing is registered (at :meth:`start`), and checks each
    optimizer of the process at its first step against the registered objects (read then,
    so a registration made after training began counts), saying the first one missing, once."""

    def __init__(
        self,
        registry: Registry,
        values: Mapping[str, Any],
        group: Any | None,
        say: Callable[[str], None] | None,
    ) -> None:
        """``values``: ``run.state``; ``group``: the ranks' group for the save's check;
        ``say``: how this rank speaks (None: it does not; rank 0 does)."""
        self._registry = registry
        self._values = values
        self._group = group
        self._say = say
        self._said_state = False
        self._checked: set[int] = set()
        self._handle: Any = None

    def check_ranks_alike(self) -> None:
        """At a save (a collective): refuse objects registered per rank under different
        names (a resume could not give each rank its own state back), and say once, on rank
        0, which ``run.state`` values differ between the ranks. One small all-reduce; the
        names and digests travel only when something differs."""
        if not several_ranks():
            return
        names = sorted(self._registry.per_rank)
        own = (names, {str(key): value_digest(value) for key, value in self._values.items()})
        whole = hashlib.sha256(repr(own).encode()).digest()
        if same_on_all_ranks(int.from_bytes(whole[:7], "little"), self._group):
            return
        listed, differing = rank_differences(all_gather_object(own, self._group))
        if listed:
            raise HpcDdpError(
                f"the ranks registered different objects per rank ({listed}): a resume could "
                "not give each rank its own state back",
                "call run.register_per_rank() with the same names on every rank, outside any "
                "`if run.rank == ...` branch",
            )
        if differing and not self._said_state and self._say is not None:
            self._said_state = True
            self._say(
                f"run.state differs between the ranks ({', '.join(differing)}): a checkpoint "
                "keeps rank 0's values, and a resume gives them to every rank. HINT: keep "
                "state that differs from rank to rank in an object registered with "
                "run.register_per_rank(...)"
            )

    def start(self) -> None:
        """Before training, on the rank that speaks."""
        if self._say is None:
            return
        if not self._registry.objects:
            self._say(NOTHING_REGISTERED)
        if self._handle is None:
            self._handle = register_optimizer_step_pre_hook(self._check)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _check(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if id(optimizer) in self._checked:
            return
        self._checked.add(id(optimizer))
        hint = unregistered_optimizer_hint(self._registry.objects, optimizer)
        if hint is not None and self._say is not None:
            self.close()
            self._say(hint)
