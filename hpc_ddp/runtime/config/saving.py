"""The ``checkpoint`` and ``preempt`` (stop signals and requeue) sections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hpc_ddp.runtime.configfile import require, setting


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints in <run dir>/checkpoints, and resuming from them."""

    enabled: bool = setting(True, "Write checkpoints (periodic, on stop signals, at the end).")
    every_steps: int | None = setting(
        None, "Save every this many optimizer steps; null: not by steps."
    )
    every_minutes: float | None = setting(
        30.0, "Save when this many minutes passed since the last save; null: not by time."
    )
    keep_last: int = setting(3, "Checkpoints kept; older ones are deleted after a good save.")
    save_mode: Literal["async", "sync", "single_file"] = setting(
        "async",
        "How checkpoints are written. async: a step-N/ folder through "
        "torch.distributed.checkpoint, every rank writing its part in the background while "
        "training goes on (stop and end saves are complete before the run goes on); sync: the "
        "same folder, training waits; single_file: rank 0 writes step-N.pt alone (the format "
        "of hpc_ddp before folders; both load whatever this setting).",
    )
    resume: bool = setting(
        True,
        "Resume from the newest loadable checkpoint of this run directory on start (a requeued "
        "Slurm job keeps its job id, so it finds its own checkpoints). false starts at step 0 "
        "and first moves the run's checkpoints to checkpoints/superseded/, so that a later "
        "resume continues the new training.",
    )
    start_fresh_if_unreadable: bool = setting(
        False,
        "When no checkpoint of the run directory loads (damaged, or of another format): false "
        "refuses to start, true moves them to checkpoints/unreadable/ and starts at step 0. "
        "Unreadable ones newer than a loadable one are always moved there.",
    )

    def __post_init__(self) -> None:
        if self.every_steps is not None:
            require(self.every_steps > 0, "checkpoint.every_steps", self.every_steps, "> 0")
        if self.every_minutes is not None:
            require(self.every_minutes > 0, "checkpoint.every_minutes", self.every_minutes, "> 0")
        require(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, ">= 1")


@dataclass(frozen=True)
class PreemptConfig:
    """Stop signals: checkpoint at a step boundary, then requeue or stop."""

    signal: Literal["USR1", "USR2", "URG", "HUP", "INT", "ALRM"] = setting(
        "USR1",
        "The warning signal of `#SBATCH --signal` (slurm/train.sh sends USR1 120 s before the "
        "time limit; submitit uses USR2). Receiving it means: checkpoint, then requeue.",
    )
    stop_on_sigterm: bool = setting(
        True,
        "SIGTERM (scancel, the time limit) also stops at the next step boundary with a "
        "checkpoint, without requeue. Runs under submitit set it false: there SIGTERM is "
        "ignored and USR2 means preemption, as submitit does it.",
    )
    requeue: bool = setting(
        True, "On the warning signal, rank 0 runs `scontrol requeue` when the job allows it."
    )
    max_requeues: int = setting(
        3, "Requeue only while SLURM_RESTART_COUNT is below this; then stop after the checkpoint."
    )
    requeue_timeout_s: float = setting(60.0, "Seconds `scontrol requeue` may take.")
    max_attempts_without_progress: int = setting(
        3,
        "A Slurm job whose last this-many attempts ended without moving the checkpoint "
        "forward (preempted or killed before their first save) ends with exit code 7 instead "
        "of training again. 0: no limit.",
    )
    requeue_delay_s: float = setting(
        0.0,
        "After hosts failed the checks, the requeued job may start again only this many "
        "seconds later (its begin time): time for the site to drain them.",
    )
    max_node_failures: int = setting(
        2,
        "Hosts failing the checks before the first step are left out of the job "
        "(ExcNodeList) and the job requeued, this many times (apart from max_requeues); "
        "then the job ends with exit code 6, naming every host it left out.",
    )
    warning_s: float = setting(
        120.0,
        "Seconds between the warning signal and the kill (`--signal=USR1@120`): a checkpoint "
        "that takes longer is named at the first save, with a HINT.",
    )
    check_every_steps: int | None = setting(
        None,
        "Optimizer steps between the ranks' agreement on stop signals (and time-based saves); "
        "a stop lands within two such periods of the signal. null: about once per second of "
        "training, measured on rank 0 and agreed by all ranks at the first log interval "
        "(every step until then).",
    )

    stop_before_end: bool = setting(
        True,
        "In a Slurm job, rank 0 reads the job's end (its time limit, re-read every "
        "end_check_every_s so a requeue or `scontrol update TimeLimit` is seen) and stops "
        "with a checkpoint and requeue early enough for the save (measured), two stop checks "
        "and end_margin_s: no warning signal needed. With one, the earlier stop wins.",
    )
    end_margin_s: float = setting(
        60.0,
        "Seconds kept free before the job's end beyond the measured save and stop checks "
        "(the requeue, the ranks' exit, a slow file system).",
    )
    end_check_every_s: float | None = setting(
        300.0,
        "Seconds between rank 0's reads of the job's end (`squeue`, in the background; a "
        "time limit changed by `scontrol update` is seen within this long, and many jobs "
        "reading more often load slurmctld); null: read once at the start.",
    )
    stop_at_step: int | None = setting(
        None,
        "Rehearse a preemption: after this optimizer step, checkpoint and stop as the warning "
        "signal does (requeue under Slurm where allowed, else exit 3 with the command that "
        "continues the run), at exactly this step on every rank. An attempt that resumes at "
        "or after it trains on. null: never.",
    )

    def __post_init__(self) -> None:
        require(self.max_requeues >= 0, "preempt.max_requeues", self.max_requeues, ">= 0")
        require(
            self.max_attempts_without_progress >= 0,
            "preempt.max_attempts_without_progress",
            self.max_attempts_without_progress,
            ">= 0",
        )
        require(self.requeue_delay_s >= 0, "preempt.requeue_delay_s", self.requeue_delay_s, ">= 0")
        require(
            self.max_node_failures >= 0,
            "preempt.max_node_failures",
            self.max_node_failures,
            ">= 0",
        )
        if self.stop_at_step is not None:
            require(self.stop_at_step >= 1, "preempt.stop_at_step", self.stop_at_step, ">= 1")
        if self.check_every_steps is not None:
            require(
                self.check_every_steps >= 1,
                "preempt.check_every_steps",
                self.check_every_steps,
                ">= 1 or null",
            )
        require(
            self.requeue_timeout_s > 0, "preempt.requeue_timeout_s", self.requeue_timeout_s, "> 0"
        )
        require(self.warning_s > 0, "preempt.warning_s", self.warning_s, "> 0")
        require(self.end_margin_s >= 0, "preempt.end_margin_s", self.end_margin_s, ">= 0")
        if self.end_check_every_s is not None:
            require(
                self.end_check_every_s > 0,
                "preempt.end_check_every_s",
                self.end_check_every_s,
                "> 0 or null",
            )
