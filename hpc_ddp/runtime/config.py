"""The runtime's settings: the sections every run has, whatever it trains.

``run`` (identity and output), ``dist`` (process group and devices), ``checkpoint``,
``preempt`` (stop signals and requeue), ``tracking`` (MLflow), ``checks`` (before the
first step) and ``monitor`` (where the time goes). :func:`hpc_ddp.start`
takes them as keyword arguments, a YAML file and/or dotted overrides; the built-in
trainer's config adds its own sections to these (:mod:`hpc_ddp.trainer.config`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hpc_ddp.runtime import configfile
from hpc_ddp.runtime.configfile import require, section, setting
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.yamlread import load_raw

#: Dotted settings from the environment (``HPC_DDP_OVERRIDES="run.id=a tracking.enabled=false"``):
#: a script's run settings changed without touching its code or its arguments.
OVERRIDES_VARIABLE = "HPC_DDP_OVERRIDES"

#: What followed ``hpc-ddp local`` on its command line (shell-quoted): the ranks name the
#: exact command that continues a stopped run.
LOCAL_COMMAND_VARIABLE = "HPC_DDP_LOCAL_COMMAND"


@dataclass(frozen=True)
class RunConfig:
    """Identity of the run and where it writes."""

    name: str | None = setting(
        None,
        "Run name: the MLflow run name and a folder under output_dir. null: the name of the "
        "script (or module) that was started.",
    )
    output_dir: str = setting(
        "runs", "Root folder for run directories and the default MLflow store (relative to cwd)."
    )
    seed: int = setting(
        0,
        "Seed for model initialisation and data order; ranks derive theirs from it. 0 to 2**63-1.",
    )
    id: str | None = setting(
        None,
        "Run directory name under output_dir/name. Default: the Slurm job id (stable across "
        "requeues), the local launcher's run id, or a timestamp.",
    )
    on_code_change: Literal["warn", "refuse"] = setting(
        "warn",
        "A resumed attempt whose script, git commit, uncommitted changes, versions or packages "
        "differ from the attempt before (provenance.json in the run directory): warn names "
        "what changed; refuse ends the attempt with that line.",
    )
    deterministic: bool = setting(
        False,
        "Deterministic kernels, set before the model is built: torch.use_deterministic_"
        "algorithms, cuBLAS's fixed workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8), cuDNN without "
        "autotuning. Two runs of one command then end bitwise equal; an operation with no "
        "deterministic kernel ends the run with torch's error and a HINT.",
    )
    log_interval: int | None = setting(
        None,
        "Optimizer steps between progress lines and interval metrics where the script's "
        "hpc_ddp.start(log_interval=...) gives none. null: about every 5 s of training "
        "(measured, so the logged steps depend on the machine's pace).",
    )

    def __post_init__(self) -> None:
        require(0 <= self.seed < 2**63, "run.seed", self.seed, "0 to 2**63-1")
        if self.log_interval is not None:
            require(self.log_interval >= 1, "run.log_interval", self.log_interval, ">= 1")
        require(bool(self.output_dir.strip()), "run.output_dir", self.output_dir, "a folder")
        if self.output_dir.startswith("~"):
            raise HpcDdpError(
                f"run.output_dir={self.output_dir!r} starts with '~', which no shell expands "
                "inside a setting: it would make a folder named '~'",
                "write the full path, e.g. run.output_dir=$HOME/runs (the shell expands $HOME)",
            )


@dataclass(frozen=True)
class DistConfig:
    """Process group and devices."""

    backend: Literal["auto", "nccl", "gloo"] = setting(
        "auto", "auto: nccl on CUDA devices, gloo on CPU."
    )
    device: Literal["auto", "cuda", "cpu"] = setting(
        "auto", "auto: CUDA when a GPU is visible, else CPU."
    )
    init_timeout_s: float = setting(
        120.0,
        "Seconds every rank waits for all ranks to reach the rendezvous before failing with "
        "an error (instead of hanging).",
    )
    timeout_s: float = setting(
        600.0, "Seconds a collective may wait for the other ranks before the job fails."
    )
    stall_timeout_s: float | None = setting(
        180.0,
        "Seconds without a finished training micro-batch after which a rank writes every "
        "thread's stack to its log and ends the job (exit 5; 4 for a rank that only waits "
        "inside torch for another), naming where it is stuck; the "
        "first batch after start is allowed timeout_s (compilation, warm-up). Evaluation and "
        "checkpoint writes are not watched. null: no watchdog.",
    )
    gpus_per_rank: int = setting(
        1,
        "GPUs each rank drives: 1 for data parallelism; k > 1 for a model split over k GPUs "
        "inside each rank (run.devices lists them; DDP across ranks). Slurm layouts: "
        "--ntasks-per-node=T with --gpus-per-node=k*T, or --gpus-per-task=k.",
    )
    master_port: int | None = setting(
        None,
        "Rendezvous port; wins over MASTER_PORT and over the port derived from the Slurm "
        "job id (10000-29999).",
    )

    strategy: Literal["ddp", "fsdp"] = setting(
        "ddp",
        "What run.wrap(model) does: ddp replicates the model on every rank "
        "(DistributedDataParallel); fsdp shards its parameters, gradients and optimizer state "
        "over the ranks (FSDP2's fully_shard), for a model that does not fit one GPU.",
    )
    shard_blocks: list[str] | None = setting(
        None,
        "fsdp: the blocks sharded one by one (names of submodules such as layers.0, or class "
        "names such as Block), then the whole model; null: each child of every ModuleList.",
    )
    mixed_precision: Literal["auto", "bf16", "fp32"] = setting(
        "auto",
        "fsdp: the dtype of the parameters in forward and backward (gradients are reduced in "
        "fp32); auto: bf16 on GPU, fp32 on CPU.",
    )

    def __post_init__(self) -> None:
        require(self.init_timeout_s > 0, "dist.init_timeout_s", self.init_timeout_s, "> 0")
        require(self.timeout_s > 0, "dist.timeout_s", self.timeout_s, "> 0")
        require(self.gpus_per_rank >= 1, "dist.gpus_per_rank", self.gpus_per_rank, ">= 1")
        if self.stall_timeout_s is not None:
            require(self.stall_timeout_s > 0, "dist.stall_timeout_s", self.stall_timeout_s, "> 0")
        if self.master_port is not None:
            require(0 < self.master_port < 65536, "dist.master_port", self.master_port, "1-65535")
        if self.backend == "nccl" and self.device == "cpu":
            raise HpcDdpError(
                "dist.backend=nccl cannot run with dist.device=cpu",
                "use dist.backend=gloo (or auto) on CPU",
            )


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
        "Peak TFLOP/s of one device, for the MFU. 0: a GPU's dense bf16 peak from the table "
        "of common GPUs (none on CPU: only the TFLOP/s achieved is logged).",
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
        False,
        "Time each rank's wait at the end of its backward for DDP's gradient all-reduce "
        "(interval/gradient_sync_percent: where a fast rank waits for a slow one and for the "
        "network), through a communication hook that reduces with DDP's own bits. Off by "
        "default: a Python call and a callback a gradient bucket (tens of µs a bucket on a "
        "CPU; bench/README.md). Models wrapped by run.wrap under DDP without a communication "
        "hook of the script's own.",
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
        "warning; system/idle_gpus counts the GPUs idle that long in each interval.",
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


@dataclass(frozen=True)
class RuntimeConfig:
    """The runtime sections of a run."""

    run: RunConfig = section(RunConfig, "Identity and output.")
    dist: DistConfig = section(DistConfig, "Distribution.")
    tracking: TrackingConfig = section(TrackingConfig, "MLflow tracking.")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "Checkpoints and resume.")
    preempt: PreemptConfig = section(PreemptConfig, "Preemption and requeue.")
    checks: ChecksConfig = section(ChecksConfig, "Checks before the first step.")
    monitor: MonitorConfig = section(MonitorConfig, "Where the run's time goes.")

    def __post_init__(self) -> None:
        if self.preempt.stop_at_step is not None and not self.checkpoint.enabled:
            raise HpcDdpError(
                f"preempt.stop_at_step={self.preempt.stop_at_step} with "
                "checkpoint.enabled=false: the rehearsed stop would save nothing to resume from",
                "turn checkpoints on, or leave preempt.stop_at_step out",
            )


Section = (
    Mapping[str, Any]
    | RunConfig
    | DistConfig
    | CheckpointConfig
    | PreemptConfig
    | TrackingConfig
    | ChecksConfig
    | MonitorConfig
)


def environment_overrides(environ: Mapping[str, str]) -> list[str]:
    """The dotted settings in $HPC_DDP_OVERRIDES (space-separated, shell quoting)."""
    text = environ.get(OVERRIDES_VARIABLE, "")
    try:
        return shlex.split(text)
    except ValueError as error:
        raise HpcDdpError(
            f"${OVERRIDES_VARIABLE}={text!r}: {error}",
            f"set {OVERRIDES_VARIABLE} to space-separated section.key=value settings",
        ) from None


def resolve_config(
    config: RuntimeConfig | str | Path | None,
    overrides: Sequence[str],
    sections: Mapping[str, Section | None],
    environ: Mapping[str, str],
) -> RuntimeConfig:
    """The runtime settings: ``config`` (an object, a YAML file or the defaults), then the
    sections given as keyword arguments, then the dotted settings in ``$HPC_DDP_OVERRIDES``
    (space-separated, shell quoting), then the dotted ``overrides`` (which win).

    Under submitit, preemption arrives as USR2 and SIGTERM is ignored, as submitit does it."""
    if isinstance(config, RuntimeConfig):
        raw, source = configfile.to_dict(config), "<config>"
    elif isinstance(config, str | Path):
        raw, source = load_raw(config), str(config)
    elif config is None:
        raw, source = {}, "<defaults>"
    else:
        raise HpcDdpError(
            f"hpc_ddp.start(config=...) got {type(config).__name__}: expected a YAML file's path "
            "or a RuntimeConfig",
            "pass dotted settings such as checkpoint.every_steps=100 as overrides=[...]",
        )
    if isinstance(overrides, str):
        raise HpcDdpError(
            f"hpc_ddp.start(overrides={overrides!r}) got one string",
            "pass a list of dotted settings, e.g. overrides=['checkpoint.every_steps=100']",
        )
    for name, value in sections.items():
        if value is None:
            continue
        if not isinstance(value, Mapping) and not (
            dataclasses.is_dataclass(value) and not isinstance(value, type)
        ):
            kind = "".join(part.title() for part in name.split("_")) + "Config"
            raise HpcDdpError(
                f"hpc_ddp.start({name}={value!r}): expected a mapping of {name} settings or "
                f"a {kind}, not a {type(value).__name__}",
                f"e.g. hpc_ddp.start({name}={{...}}); `hpc-ddp config` lists every key",
            )
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            raw[name] = dataclasses.asdict(value)
        else:
            raw.setdefault(name, {}).update(dict(value))  # type: ignore[arg-type]
    sections_known = configfile.section_names(RuntimeConfig)
    text = configfile.text_keys(RuntimeConfig)
    from_environ = environment_overrides(environ)
    try:
        if from_environ:
            configfile.apply_overrides(raw, from_environ, sections_known, text)
            configfile.from_dict(RuntimeConfig, copy.deepcopy(raw), source)  # unknown keys
    except (ValueError, HpcDdpError) as error:
        raise HpcDdpError(
            f"${OVERRIDES_VARIABLE}={environ[OVERRIDES_VARIABLE]!r}: {error}",
            f"set {OVERRIDES_VARIABLE} to space-separated section.key=value settings",
        ) from None
    configfile.apply_overrides(raw, overrides, sections_known, text)
    settings = configfile.from_dict(RuntimeConfig, raw, source)
    if environ.get("SUBMITIT_EXECUTOR"):
        preempt = dataclasses.replace(settings.preempt, signal="USR2", stop_on_sigterm=False)
        settings = dataclasses.replace(settings, preempt=preempt)
    return settings


def default_run_name() -> str:
    """The started script's (or module's) name: ``train`` for ``train.py``."""
    started = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-m") else ""
    return Path(started).stem or "run"
