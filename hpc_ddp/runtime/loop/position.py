"""Where a run is: the numbers the loop counts and a checkpoint records."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpc_ddp.runtime.monitor.attempt_times import AttemptTimes, StepsMark


class TrainClock:
    """The time the ``run.steps`` loop in progress has trained, less the time the process
    did not run: part of the position that a checkpoint written mid-epoch records."""

    def __init__(self) -> None:
        self._since: tuple[float, StepsMark, AttemptTimes] | None = None

    def start(self, times: AttemptTimes) -> tuple[float, StepsMark]:
        """Start at an epoch's loop; returns the clock's reading and ``times``' mark then."""
        started, began = time.perf_counter(), times.mark()
        self._since = (started, began, times)
        return started, began

    def running_s(self) -> float:
        """The seconds trained since :meth:`start` (0 between loops)."""
        if self._since is None:
            return 0.0
        started, began, times = self._since
        return times.ran_s(time.perf_counter() - started, began)

    def stop(self) -> float:
        """The seconds trained since :meth:`start`, as the loop ends."""
        seconds, self._since = self.running_s(), None
        return seconds


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
    #: The epoch in progress's training time, not yet in ``train_time_s``.
    clock: TrainClock = field(default_factory=TrainClock, compare=False, repr=False)

    def saved(self) -> dict[str, int | float]:
        """The numbers a checkpoint keeps (mid-epoch, the epoch's time so far too: a resume
        goes on from there)."""
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "global_step": self.global_step,
            "train_time_s": self.train_time_s + self.clock.running_s(),
        }

    def summary(self, global_batch_size: int) -> dict[str, Any]:
        """What the run's summary says of where it ended (``global_batch_size``: samples per
        optimizer step over all ranks; 0: unknown, batches that hold no tensor, whose
        samples are then null rather than 0)."""
        samples = self.global_step * global_batch_size if global_batch_size > 0 else None
        # The rates derive from the time as the summary states it, so that every rate
        # computed from the summary (tokens/s too) agrees with them.
        train_time_s = round(self.train_time_s, 3)
        return {
            "resumed_from_step": self.resumed_from_step,
            "resumed_from_world_size": self.resumed_from_world_size,
            "epochs": self.epoch,
            "global_step": self.global_step,
            "samples_seen": samples,
            "train_time_s": train_time_s,
            "samples_per_s": None
            if samples is None
            else round(samples / max(1e-9, train_time_s), 1),
            "replicas_in_sync": self.replicas_diverged_at is None,
            "replicas_diverged_at": self.replicas_diverged_at,
            "first_step_unix": self.first_step_unix,
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


_KEEP: Any = object()


@dataclass
class Limits:
    """When the run ends: after ``num_epochs`` epochs or ``max_steps`` optimizer steps (over
    all attempts), whichever comes first; None: no such limit."""

    num_epochs: int | None = None
    max_steps: int | None = None

    def set(self, *, num_epochs: int | None = _KEEP, max_steps: int | None = _KEEP) -> None:
        """New limits; one not given stays as it was."""
        if num_epochs is not _KEEP:
            self.num_epochs = num_epochs
        if max_steps is not _KEEP:
            self.max_steps = max_steps

    def more_epochs(self, position: Position) -> bool:
        """Whether an epoch is left (a resumed epoch part-way always goes on)."""
        if position.step_in_epoch > 0:
            return True
        if self.num_epochs is not None and position.epoch >= self.num_epochs:
            return False
        return self.max_steps is None or position.global_step < self.max_steps

    def total_steps(self, steps_per_epoch: int | None) -> int | None:
        """The run's last step over all attempts, where the limits say (None: unknown)."""
        known = [] if self.max_steps is None else [self.max_steps]
        if self.num_epochs is not None and steps_per_epoch is not None:
            known.append(self.num_epochs * steps_per_epoch)
        return min(known) if known else None

    def steps_left(self, position: Position, steps_per_epoch: int | None) -> float:
        """Optimizer steps left in this epoch (inf: an endless one without a step limit)."""
        total = self.total_steps(steps_per_epoch)
        left = math.inf if steps_per_epoch is None else steps_per_epoch - position.step_in_epoch
        return left if total is None else min(left, total - position.global_step)
