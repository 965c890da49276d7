"""Where a run is: the numbers the loop counts and a checkpoint records."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Position:
    """Where the run is on this rank; what a checkpoint records of it."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    train_time_s: float = 0.0
    resumed_from_step: int | None = None
    #: The world size of the checkpoint resumed from (None: a fresh run).
    resumed_from_world_size: int | None = None
    stopped: bool = False
    #: Set when the run's epochs ran to their end.
    completed: bool = False
    last_checkpoint_step: int = -1
    last_save_time: float = field(default_factory=time.monotonic)
    #: Wall-clock time (Unix) of this process's first finished optimizer step.
    first_step_unix: float | None = None
    #: The first step after which some rank's weights differed from rank 0's (None: never).
    replicas_diverged_at: int | None = None

    def saved(self) -> dict[str, int | float]:
        """The numbers a checkpoint keeps."""
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "global_step": self.global_step,
            "train_time_s": self.train_time_s,
        }

    def restore(self, saved: Mapping[str, Any], world_size: int) -> None:
        """Continue at a checkpoint's numbers (written by ``world_size`` ranks)."""
        self.epoch = int(saved["epoch"])
        self.step_in_epoch = int(saved["step_in_epoch"])
        self.global_step = int(saved["global_step"])
        self.train_time_s = float(saved["train_time_s"])
        self.resumed_from_step = self.global_step
        self.resumed_from_world_size = world_size
        self.last_checkpoint_step = self.global_step
