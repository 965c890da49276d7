"""State a resume would get wrong: nothing registered, or a model given to ``run.wrap`` left
out (said before training), an optimizer that steps a registered model unregistered (said at
its first step), values of ``run.state``
that differ between the ranks (a checkpoint keeps rank 0's; said at a save), and objects
registered per rank under different names (refused at a save).

An optimizer is recognised by stepping, through torch's global optimizer step hook, not by
its absence from the registered objects: a script that updates its weights by hand (no
optimizer, as in a truncated-BPTT language model with a manual SGD step) has no optimizer
state to lose, and is told nothing."""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hpc_ddp.runtime.checkpoint.fingerprint import rank_differences, value_digest
from hpc_ddp.runtime.checkpoint.state import Registry, check_loadable
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.place.dist import all_gather_object, same_on_all_ranks, several_ranks

#: What a resume would leave out when nothing is registered.
NOTHING_REGISTERED = (
    "nothing is registered for checkpoints: a resumed run could not restore its model. "
    "HINT: run.register(model=model, optimizer=optimizer) before training"
)


def holds(value: object, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``value`` is ``optimizer`` or an optimizer wrapping it, whose state holds it
    (ZeroRedundancyOptimizer keeps its inner one); a scheduler, which keeps its optimizer
    but not its state, does not count."""
    return value is optimizer or (
        isinstance(value, torch.optim.Optimizer)
        and any(item is optimizer for item in vars(value).values())
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


def unregistered_models_hint(
    registered: Mapping[str, object], wrapped: Sequence[nn.Module]
) -> str | None:
    """What a resume would get wrong when a model given to ``run.wrap`` is not registered:
    one is registered when it, its wrapper or a registered module holding its parameters is
    (None: every one is)."""
    held = {
        id(parameter)
        for value in registered.values()
        if isinstance(value, nn.Module)
        for parameter in value.parameters()
    }
    modules = {id(value) for value in registered.values() if isinstance(value, nn.Module)}
    modules |= {id(value.module) for value in registered.values() if hasattr(value, "module")}
    missing = [
        type(model).__name__
        for model in wrapped
        if id(model) not in modules and not any(id(p) in held for p in model.parameters())
    ]
    if not missing:
        return None
    which = ", ".join(missing)
    return (
        f"{'a model' if len(missing) == 1 else 'models'} given to run.wrap ({which}) "
        f"{'is' if len(missing) == 1 else 'are'} not registered: a checkpoint leaves out "
        "its weights and a resume starts them again from their first values, with its "
        "optimizer's state. HINT: register every model trained and its optimizer, e.g. "
        "run.register(model=model, optimizer=optimizer, critic=critic, "
        "critic_optimizer=critic_optimizer)"
    )


#: How the warnings of state a resume gets wrong begin (these, and the one for a
#: ``run.train_loader`` iterated without ``run.steps``): ``check-resume`` names them first.
LOSES_WORK = (
    NOTHING_REGISTERED.split(":")[0],
    "an optimizer (",
    "a model given to run.wrap (",
    "models given to run.wrap (",
    "run.state differs between the ranks (",
    "run.train_loader(...) is iterated directly",
)


class RegistrationWatch:
    """Says through ``say`` when nothing is registered or a wrapped model is not (at
    :meth:`start`), and checks each
    optimizer of the process at its first step against the registered objects (read then,
    so a registration made after training began counts), saying the first one missing, once."""

    def __init__(
        self,
        registry: Registry,
        values: Mapping[str, Any],
        wrapped: Sequence[nn.Module],
        group: Any | None,
        say: Callable[[str], None] | None,
    ) -> None:
        """``values``: ``run.state``; ``wrapped``: the models given to ``run.wrap``;
        ``group``: the ranks' group for the save's check; ``say``: how this rank speaks
        (None: it does not; rank 0 does)."""
        self._registry = registry
        self._wrapped = wrapped
        self._values = values
        self._group = group
        self._say = say
        self._said_state = self._said_optimizer = False
        #: The optimizers checked at their first step (weakly: one made anew each epoch is
        #: checked anew).
        self._checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._handle: Any = None

    def check_ranks_alike(self) -> None:
        """At a save (a collective): refuse objects registered per rank under different
        names (a resume could not give each rank its own state back), and say once, on rank
        0, which ``run.state`` values differ between the ranks. One small all-reduce; the
        names and digests travel only when something differs."""
        check_loadable("run.state", self._values)  # refused as such, not named as differing
        if not several_ranks():
            return
        names = sorted(self._registry.per_rank)
        digests = {str(key): value_digest(value) for key, value in self._values.items()}
        own = (names, dict(sorted(digests.items())))
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
        else:
            registered = {**self._registry.objects, **self._registry.per_rank}
            hint = unregistered_models_hint(registered, self._wrapped)
            if hint is not None:
                self._say(hint)
        if self._handle is None:
            self._handle = register_optimizer_step_pre_hook(self._check)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _check(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if self._said_optimizer or optimizer in self._checked:
            return
        self._checked.add(optimizer)
        registered = {**self._registry.objects, **self._registry.per_rank}
        hint = unregistered_optimizer_hint(registered, optimizer)
        if hint is not None and self._say is not None and not self._said_optimizer:
            # Said once; the hook stays until close(): removing it here would change the
            # hooks torch is iterating over.
            self._said_optimizer = True
            self._say(hint)
