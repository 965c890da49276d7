"""The ``run`` (identity and output) and ``dist`` (process group and devices) sections."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hpc_ddp.runtime.configfile import require, setting
from hpc_ddp.runtime.errors import HpcDdpError


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
