"""State a resume needs that the script did not register: nothing at all (said before
training), or an optimizer that steps a registered model (said at its first step).

An optimizer is recognised by stepping, through torch's global optimizer step hook, not by
its absence from the registered objects: a script that updates its weights by hand (no
optimizer, as in a truncated-BPTT language model with a manual SGD step) has no optimizer
state to lose, and is told nothing."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

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


class RegistrationWatch:
    """Says through ``say`` when nothing is registered (at :meth:`start`), and checks each
    optimizer of the process at its first step against the registered objects (read then,
    so a registration made after training began counts), saying the first one missing, once."""

    def __init__(self, registered: Mapping[str, object], say: Callable[[str], None]) -> None:
        self._registered = registered
        self._say = say
        self._checked: set[int] = set()
        self._handle: Any = None

    def start(self) -> None:
        if not self._registered:
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
        hint = unregistered_optimizer_hint(self._registered, optimizer)
        if hint is not None:
            self.close()
            self._say(hint)
