"""User-style factories named by import path in tests (data.factory / model.factory)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset


def tiny_dataset(config: Any, seed: int) -> tuple[TensorDataset, TensorDataset, int, int]:
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(300, 5, generator=generator)
    labels = (features[:, 0] > 0).long()
    return (
        TensorDataset(features[:256], labels[:256]),
        TensorDataset(features[256:], labels[256:]),
        5,
        2,
    )


def linear_model(config: Any, num_features: int, num_classes: int) -> nn.Module:
    return nn.Linear(num_features, num_classes)


class _FaultOnRankOne(nn.Module):
    """A linear model whose rank 1 runs ``fault`` on its ``on_call``-th forward pass."""

    def __init__(
        self,
        num_features: int,
        num_classes: int,
        on_call: int,
        fault: Callable[[nn.Linear], None],
    ) -> None:
        super().__init__()
        self.linear = nn.Linear(num_features, num_classes)
        self.on_call = on_call
        self.fault = fault
        self.calls = 0

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if os.environ.get("RANK") == "1" and self.calls == self.on_call:
            self.fault(self.linear)
        return self.linear(features)  # type: ignore[no-any-return]


def _raise(linear: nn.Linear) -> None:
    raise RuntimeError("injected failure on rank 1")


def _stall(linear: nn.Linear) -> None:
    time.sleep(3600)


def _nudge_bias(linear: nn.Linear) -> None:
    with torch.no_grad():
        linear.bias.add_(0.5)


def failing_model(config: Any, num_features: int, num_classes: int) -> nn.Module:
    """Rank 1 raises on its 4th forward pass, while rank 0 goes on into the next all-reduce."""
    return _FaultOnRankOne(num_features, num_classes, 4, _raise)


def _kill_in_the_first_attempt(linear: nn.Linear) -> None:
    if "SLURM_JOB_ID" in os.environ and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)


def killed_model(config: Any, num_features: int, num_classes: int) -> nn.Module:
    """Rank 1 of a Slurm job's first attempt is killed (SIGKILL, as by a failing host) on its
    12th forward pass; elsewhere a plain linear model."""
    return _FaultOnRankOne(num_features, num_classes, 12, _kill_in_the_first_attempt)


def killed_while_building(config: Any, num_features: int, num_classes: int) -> nn.Module:
    """Rank 1 of a Slurm job's first attempt is killed (SIGKILL, as by a failing host) while
    the model is built, before the first step; elsewhere the plain linear model of
    :func:`killed_model` (the same weights)."""
    first_attempt = os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
    if "SLURM_JOB_ID" in os.environ and first_attempt and os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return _FaultOnRankOne(num_features, num_classes, 0, _kill_in_the_first_attempt)


def _freeze_in_the_first_attempt(linear: nn.Linear) -> None:
    if "SLURM_JOB_ID" in os.environ and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops, as on a frozen host


def frozen_model(config: Any, num_features: int, num_classes: int) -> nn.Module:
    """Rank 1 of a Slurm job's first attempt freezes (SIGSTOP: it answers nothing, not even
    a signal, as on a host that hangs) on its 12th forward pass; elsewhere a plain linear
    model."""
    return _FaultOnRankOne(num_features, num_classes, 12, _freeze_in_the_first_attempt)


def not_a_module(config: Any, num_features: int, num_classes: int) -> object:
    return "not a module"


def hanging_model(config: Any, num_features: int, num_classes: int) -> nn.Module:
    """Rank 1 stops making progress (outside any collective) on its 4th forward pass."""
    return _FaultOnRankOne(num_features, num_classes, 4, _stall)


def drifting_model(config: Any, num_features: int, num_classes: int) -> nn.Module:
    """Rank 1 changes its own weights outside the optimizer on its 3rd forward pass: the user
    error that leaves DDP replicas silently different."""
    return _FaultOnRankOne(num_features, num_classes, 3, _nudge_bias)


def dataset_without_seed(config: Any) -> tuple[TensorDataset, TensorDataset, int, int]:
    """A data factory with the wrong signature: it takes no seed."""
    return tiny_dataset(config, 0)


def strings_dataset(config: Any, seed: int) -> tuple[str, str, int, int]:
    return "train", "val", 5, 2


def empty_val_dataset(config: Any, seed: int) -> tuple[TensorDataset, TensorDataset, int, int]:
    train, _val, features, classes = tiny_dataset(config, seed)
    empty = TensorDataset(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long))
    return train, empty, features, classes


def read_the_labels_file(config: Any, seed: int) -> tuple[TensorDataset, TensorDataset, int, int]:
    """A data factory whose own code fails, as a user's does."""
    with open("/nonexistent/labels.csv") as handle:
        handle.read()
    return tiny_dataset(config, seed)


def model_without_classes(config: Any, num_features: int) -> nn.Module:
    return nn.Linear(num_features, 2)


def too_narrow_model(config: Any, num_features: int, num_classes: int) -> nn.Module:
    """Takes one feature fewer than the data has."""
    return nn.Linear(num_features - 1, num_classes)


def wrong_outputs_model(config: Any, num_features: int, num_classes: int) -> nn.Module:
    return nn.Linear(num_features, num_classes + 3)


#: The training forward pass at which the held and killed models act: that of step 61 (or
#: 31) of LONG's 400-step epoch, in its first attempt.
HOLD_AT_FORWARD = 61
KILL_AT_FORWARD = 31


def _first_round_of_a_job() -> bool:
    """In a Slurm job's first attempt and (under torchrun) its first round of workers."""
    return (
        "SLURM_JOB_ID" in os.environ
        and os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
        and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    )


class _ActsAtForward(nn.Module):
    """The built-in trainer's MLP that runs ``act`` before its ``on_call``-th training forward
    pass in a job's first round (elsewhere, as in an uninterrupted reference run, it is the
    MLP: the same weights)."""

    def __init__(self, config: Any, num_features: int, num_classes: int, on_call: int,
                 act: Callable[[], None]) -> None:  # fmt: skip
        super().__init__()
        from hpc_ddp.trainer.models import MLP

        model = config.model
        self.mlp = MLP(num_features, list(model.hidden_sizes), num_classes, model.dropout)
        self.on_call, self.act, self.calls = on_call, act, 0

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.on_call and _first_round_of_a_job():
                self.act()
        return self.mlp(features)  # type: ignore[no-any-return]


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def held_until_a_warning_signal(config: Any, num_features: int, num_classes: int) -> nn.Module:
    """Every rank of a job's first round says ``HOLDING at step 60 (rank r)`` and holds
    until a warning signal (USR1 or USR2; submitit's preemption sends SIGTERM first) reached
    it: one sent on that line lands at step 60 however fast the machine trains (the stop
    comes at step 62: the stop agreement started in step 61 is read in the next)."""
    from tests.programs.holding import StopSignalSeen

    seen = StopSignalSeen()  # after hpc_ddp.start, which installed the handlers it wraps
    warnings = (signal.SIGUSR1, signal.SIGUSR2)
    return _ActsAtForward(config, num_features, num_classes, HOLD_AT_FORWARD,
                          lambda: seen.hold(_rank(), HOLD_AT_FORWARD - 1, warnings))  # fmt: skip


def held_until_released(config: Any, num_features: int, num_classes: int) -> nn.Module:
    """Every rank of a job's first round says ``HOLDING at step 60 (rank r)`` and holds
    until the test makes the file ``release`` in run.output_dir (it changes the job
    meanwhile, e.g. its time limit, and waits for the run to see it)."""
    from tests.programs.holding import FileAppears

    released = FileAppears(str(Path(config.run.output_dir) / "release"))
    return _ActsAtForward(config, num_features, num_classes, HOLD_AT_FORWARD,
                          lambda: released.hold(_rank(), HOLD_AT_FORWARD - 1))  # fmt: skip


def _killed_once_checkpointed(config: Any, rank: int) -> Callable[[], None]:
    """Rank ``rank`` waits for the run's first whole checkpoint, then is killed (SIGKILL,
    as by a failing host); the other ranks go on into the next collective."""

    def kill() -> None:
        if int(os.environ.get("RANK", "-1")) != rank:
            return
        from hpc_ddp.runtime.checkpoint.files import list_checkpoints

        runs = Path(config.run.output_dir)
        deadline = time.monotonic() + 300
        while not any(list_checkpoints(folder) for folder in runs.glob("*/*/checkpoints")):
            if time.monotonic() > deadline:
                raise SystemExit(f"rank {rank}: no checkpoint in {runs} after 300 s")
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)

    return kill


def rank1_killed_once_checkpointed(config: Any, num_features: int, num_classes: int) -> nn.Module:
    """Rank 1 of a job's first round is killed at step 30, once a checkpoint is whole."""
    return _ActsAtForward(config, num_features, num_classes, KILL_AT_FORWARD,
                          _killed_once_checkpointed(config, 1))  # fmt: skip


def rank3_killed_once_checkpointed(config: Any, num_features: int, num_classes: int) -> nn.Module:
    """Rank 3 (on the second of 2 nodes) of a job's first round is killed at step 30, once a
    checkpoint is whole."""
    return _ActsAtForward(config, num_features, num_classes, KILL_AT_FORWARD,
                          _killed_once_checkpointed(config, 3))  # fmt: skip


def _in_attempt(restart: int) -> bool:
    """In the Slurm job's attempt after ``restart`` requeues."""
    return "SLURM_JOB_ID" in os.environ and os.environ.get("SLURM_RESTART_COUNT", "0") == str(
        restart
    )


def _newest_checkpoint_step(output_dir: str) -> int:
    """The step of the newest whole checkpoint of the runs under ``output_dir`` (-1: none)."""
    from hpc_ddp.runtime.checkpoint.files import checkpoint_step, list_checkpoints

    found = [list_checkpoints(folder) for folder in Path(output_dir).glob("*/*/checkpoints")]
    return max((checkpoint_step(path) for paths in found for path in paths), default=-1)


def _killed_once_a_newer_checkpoint_is_whole(config: Any, rank: int) -> Callable[[], None]:
    """Rank ``rank`` waits until a checkpoint newer than those there now (as the model is
    built: the one its attempt resumes from) is whole, then is killed (SIGKILL, as by a
    failing host)."""
    resumed = _newest_checkpoint_step(config.run.output_dir)

    def kill() -> None:
        if _rank() != rank:
            return
        deadline = time.monotonic() + 300
        while _newest_checkpoint_step(config.run.output_dir) <= resumed:
            if time.monotonic() > deadline:
                raise SystemExit(f"rank {rank}: no checkpoint after step {resumed} in 300 s")
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)

    return kill


class _HeldThenKilled(nn.Module):
    """The built-in trainer's MLP whose every rank holds at step 60 of a job's first attempt
    until a warning signal reached it, and whose rank 1 is killed in the second attempt,
    on its 31st training forward, once a checkpoint of that attempt is whole."""

    def __init__(self, config: Any, num_features: int, num_classes: int) -> None:
        super().__init__()
        from hpc_ddp.trainer.models import MLP
        from tests.programs.holding import StopSignalSeen

        model = config.model
        self.mlp = MLP(num_features, list(model.hidden_sizes), num_classes, model.dropout)
        seen = StopSignalSeen()
        warnings = (signal.SIGUSR1, signal.SIGUSR2)
        self.acts = {
            0: (HOLD_AT_FORWARD, lambda: seen.hold(_rank(), HOLD_AT_FORWARD - 1, warnings)),
            1: (KILL_AT_FORWARD, _killed_once_a_newer_checkpoint_is_whole(config, 1)),
        }
        self.calls = 0

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            for restart, (on_call, act) in self.acts.items():
                if self.calls == on_call and _in_attempt(restart):
                    act()
        return self.mlp(features)  # type: ignore[no-any-return]


def held_then_rank1_killed(config: Any, num_features: int, num_classes: int) -> nn.Module:
    """A job's first attempt holds at step 60 for a warning signal; in its second, rank 1 is
    killed outright once that attempt's first checkpoint is whole."""
    return _HeldThenKilled(config, num_features, num_classes)
