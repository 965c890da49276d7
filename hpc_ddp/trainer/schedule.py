"""The learning-rate schedule: linear warmup, then constant, linear or cosine decay."""

from __future__ import annotations

import math
from typing import Any

import torch


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """Multiplier on the peak lr at optimizer step ``step`` (0-based)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, progress))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class LrSchedule:
    """Sets each parameter group's lr to its peak lr times :func:`lr_factor`.

    It writes the optimizer only when the factor changes, so a constant schedule costs
    nothing per step. (torch's LambdaLR also wraps ``optimizer.step`` and rebuilds its lr
    lists on every step.) The state is the step count alone, under LambdaLR's key
    ``last_epoch``, so either's checkpoint restores into the other's position.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_steps: int,
        total_steps: int,
        schedule: str,
    ) -> None:
        self.optimizer = optimizer
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.schedule = schedule
        self.peak_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self.steps_done = 0
        self._factor: float | None = None
        self._apply()

    def _apply(self) -> None:
        factor = lr_factor(self.steps_done, self.warmup_steps, self.total_steps, self.schedule)
        if factor != self._factor:
            for group, peak in zip(self.optimizer.param_groups, self.peak_lrs, strict=True):
                group["lr"] = peak * factor
            self._factor = factor

    def step(self) -> None:
        """After each optimizer step: move to the next step's lr."""
        self.steps_done += 1
        self._apply()

    @property
    def lr(self) -> float:
        """The first parameter group's current lr."""
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.steps_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps_done = int(state["last_epoch"])
        self._factor = None
        self._apply()
