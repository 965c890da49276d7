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


#: What is said of an optimizer that steps a registered model unregistered (its kind, the
#: models' names).
OPTIMIZER_NOT_REGISTERED = (
    "an optimizer ({kind}) steps the registered {models} but is not registered"
)
#: What is said of models given to run.wrap and not registered: one of them, several.
MODEL_NOT_REGISTERED = (
    "a model given to run.wrap ({models}) is not registered",
    "models given to run.wrap ({models}) are not registered",
)
REGISTER_EVERY_MODEL = (
    "register every model trained and its optimizer, e.g. run.register(model=model, "
    "optimizer=optimizer, critic=critic, critic_optimizer=critic_optimizer)"
)
#: What is said of run.state values that differ between the ranks (their keys).
STATE_DIFFERS = "run.state differs between the ranks ({keys})"


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
        OPTIMIZER_NOT_REGISTERED.format(kind=type(optimizer).__name__, models=", ".join(models))
        + ": a resume restarts its state (momentum, "
        "Adam's moments, its step count) and goes on differently from an uninterrupted run. "
        "HINT: run.register(model=model, optimizer=optimizer, scheduler=...) with every "
        "object whose state training changes"
    )


def held_parameters(registered: Mapping[str, object]) -> set[int]:
    """The ids of the parameters a checkpoint keeps: of each registered module, and of the
    modules an object of the script's own holds (``run.register(gan=GanState(G, D))``)."""
    modules = [value for value in registered.values() if isinstance(value, nn.Module)]
    modules += [
        inner
        for value in registered.values()
        if not isinstance(value, nn.Module) and hasattr(value, "__dict__")
        for inner in vars(value).values()
        if isinstance(inner, nn.Module)
    ]
    return {id(parameter) for module in modules for parameter in module.parameters()}


def _ordinal(number: int) -> str:
    suffix = (
        "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    )
    return f"{number}{suffix}"


def unregistered_models_hint(
    registered: Mapping[str, object], wrapped: Sequence[nn.Module]
) -> str | None:
    """What a resume would get wrong when a model given to ``run.wrap`` trains parameters
    no checkpoint keeps (None: none does). A frozen model (no parameter that requires a
    gradient, as a teacher's) has nothing to lose."""
    held = held_parameters(registered)
    missing = []
    for place, model in enumerate(wrapped, start=1):
        trained = [p for p in model.parameters() if p.requires_grad]
        if any(id(parameter) not in held for parameter in trained):
            count = sum(parameter.numel() for parameter in trained)
            missing.append(f"the {_ordinal(place)}: {type(model).__name__}, {count:,} parameters")
    if not missing:
        return None
    one = len(missing) == 1
    said = MODEL_NOT_REGISTERED[0 if one else 1].format(models="; ".join(missing))
    its, optimizers = ("its", "optimizer's") if one else ("their", "optimizers'")
    return (
        f"{said}: a checkpoint leaves out {its} weights and a resume starts them again from "
        f"their first values, with {its} {optimizers} state. HINT: {REGISTER_EVERY_MODEL}"
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
                STATE_DIFFERS.format(keys=", ".join(differing)) + ": a checkpoint "
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
            registered = self._registry_now()
            hint = unregistered_models_hint(registered, self._wrapped)
            if hint is not None:
                self._say(hint)
        if self._handle is None:
            self._handle = register_optimizer_step_pre_hook(self._check)

    def _registry_now(self) -> dict[str, Any]:
        """Every registered object, per rank ones included, as registered at this moment."""
        return {**self._registry.objects, **self._registry.per_rank}

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _check(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if self._said_optimizer or optimizer in self._checked:
            return
        self._checked.add(optimizer)
        registered = self._registry_now()
        hint = unregistered_optimizer_hint(registered, optimizer)
        if hint is not None and self._say is not None and not self._said_optimizer:
            # Said once; the hook stays until close(): removing it here would change the
            # hooks torch is iterating over.
            self._said_optimizer = True
            self._say(hint)
