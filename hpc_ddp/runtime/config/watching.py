"""The ``tracking`` (MLflow), ``checks`` (before the first step) and ``monitor`` (where
the time goes) sections."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpc_ddp.runtime.configfile import require, setting


@dataclass(frozen=True)
class TrackingConfig:
    """MLflow tracking (rank 0 only)."""

    enabled: bool = setting(True, "Track the run in MLflow.")
    uri: str | None = setting(
        None,
        "MLflow tracking URI (e.g. http://mlflow.lab:5000). Default: an embedded SQLite store "
        "at <output_dir>/mlflow.db, no server needed.",
    )
    experiment: str = setting("hpc_ddp", "MLflow experiment name.")
    retry_s: float = setting(
        60.0,
        "After MLflow failed: seconds between background attempts to reach it again; when "
        "one succeeds, the run's record (metrics.jsonl) is replayed and tracking goes on.",
    )

    def __post_init__(self) -> None:
        require(self.retry_s > 0, "tracking.retry_s", self.retry_s, "> 0")


@dataclass(frozen=True)
class ChecksConfig:
    """Checks before the first step, on every rank: found in seconds and named by host."""

    enabled: bool = setting(
        True,
        "Check each GPU (a product with a known result, free memory), the collective path "
        "(an all-reduce of known values), the run directory (an fsynced write, room for "
        "checkpoint.keep_last + 1 checkpoints) and checks.command before training; a failure "
        "ends the job with one line per host. Their cost is said at start.",
    )
    command: str | None = setting(
        None,
        "A site's own node health check (a shell command, e.g. /etc/slurm/healthcheck.sh), run "
        "once per node before training; a non-zero exit fails that node, its output quoted.",
    )
    timeout_s: float = setting(60.0, "Seconds checks.command may take before it fails its node.")
    min_free_gpu_memory: float = setting(
        0.5,
        "Fraction of each GPU's memory that must be free at start: less means another process "
        "holds it (a previous job's, say), and the GPU fails its check. 0 to 1.",
    )
    min_allreduce_gbps: float | None = setting(
        None,
        "Bandwidth floor of the collective path in GB/s (bus bandwidth of a 64 MB all-reduce, "
        "timed after one warm-up); null: not measured.",
    )

    def __post_init__(self) -> None:
        require(self.timeout_s > 0, "checks.timeout_s", self.timeout_s, "> 0")
        require(
            0 <= self.min_free_gpu_memory <= 1,
            "checks.min_free_gpu_memory",
            self.min_free_gpu_memory,
            "0 to 1",
        )
        if self.min_allreduce_gbps is not None:
            require(
                self.min_allreduce_gbps > 0,
                "checks.min_allreduce_gbps",
                self.min_allreduce_gbps,
                "> 0 or null",
            )


@dataclass(frozen=True)
class MonitorConfig:
    """Where the run's time goes, measured on every rank and said on rank 0."""

    data_wait_percent: float = setting(
        20.0,
        "Share of the time (%) a rank may wait for its next batch: above it for several "
        "log intervals in a row, rank 0 names the rank and the loader's settings once, with a "
        "HINT (workers, pinned memory, prefetch). 100: never said.",
    )
    tokens_per_sample: float = setting(
        0.0,
        "Tokens in one sample (a language model's sequence length): with it, each interval "
        "logs its tokens/s (interval/tokens_per_s) beside samples/s. 0: not said.",
    )
    flops_per_sample: float = setting(
        0.0,
        "Floating-point operations to train on one sample, forward and backward (about 6 x "
        "parameters x tokens for a transformer): with it, each interval logs the TFLOP/s "
        "achieved over all ranks (interval/tflops) and, where a device's peak is known, the "
        "model FLOPs utilisation (interval/mfu_percent). 0: not said.",
    )
    peak_tflops: float = setting(
        0.0,
        "Peak TFLOP/s of one device, for the MFU. 0: a GPU's dense peak from the table of "
        "common GPUs, for the format the wrapped model's training forward runs in "
        "(autocast's, else its parameters'; bf16 where not known); none on CPU: only the "
        "TFLOP/s achieved is logged.",
    )
    count_flops: bool = setting(
        True,
        "With flops_per_sample=0: count them from the model, once, on rank 0's first "
        "training forward (torch's FlopCounterMode on a copy of the model on the meta device: "
        "shapes only, nothing computed). Models wrapped by run.wrap under DDP.",
    )
    straggler_ratio: float = setting(
        1.2,
        "A rank whose model's forward takes more than this times the median rank's in a log "
        "interval is its straggler (interval/slowest_rank, interval/slowest_rank_ratio); one "
        "that stays the straggler for 3 intervals in a row is named once, with its host. "
        "Models wrapped by run.wrap under DDP.",
    )
    time_gradient_sync: bool = setting(
        True,
        "Time each rank's wait at the end of its backward for DDP's gradient all-reduce "
        "(interval/gradient_sync_percent: where a fast rank waits for a slow one and for the "
        "network), with a gradient hook and two autograd callbacks a backward; DDP reduces "
        "as its own. Models wrapped by run.wrap under DDP.",
    )

    every_s: float = setting(
        10.0,
        "Seconds between readings of each rank's GPU (utilisation, memory, power, "
        "temperature, through NVML) and its processes' memory, on a thread of its own; their "
        "CPU time is read at every log interval (system/<host>/... metrics). 0: no "
        "readings, no system metrics.",
    )
    idle_gpu_percent: float = setting(
        5.0,
        "A GPU of the job below this utilisation (%) without a break counts as idle.",
    )
    idle_after_s: float = setting(
        900.0,
        "Seconds a GPU may stay idle before rank 0 names it (host, GPU, rank) in one "
        "warning and the run's hpc_ddp.idle_gpus tag; system/idle_gpus counts the GPUs idle "
        "that long in each interval.",
    )
    idle_stop: bool = setting(
        False,
        "With a GPU idle for idle_after_s: stop the run with a checkpoint, as scancel's "
        "SIGTERM does (exit 3, no requeue), before a site that polices idle GPUs ends it.",
    )

    def __post_init__(self) -> None:
        require(
            0 < self.data_wait_percent <= 100,
            "monitor.data_wait_percent",
            self.data_wait_percent,
            "above 0 and at most 100",
        )
        require(
            math.isfinite(self.straggler_ratio) and self.straggler_ratio >= 1,
            "monitor.straggler_ratio",
            self.straggler_ratio,
            "a number >= 1",
        )
        require(
            0 <= self.idle_gpu_percent <= 100,
            "monitor.idle_gpu_percent",
            self.idle_gpu_percent,
            "between 0 and 100",
        )
        for name in ("tokens_per_sample", "flops_per_sample", "peak_tflops", "every_s",
                     "idle_after_s"):  # fmt: skip
            value = getattr(self, name)
            require(math.isfinite(value) and value >= 0, f"monitor.{name}", value, "a number >= 0")
