"""The built-in trainer's config: the runtime sections plus data, model, optim and train.

``load_config("configs/digits.yaml", ["train.epochs=3", "data.batch_size=128"])``; the same
strict loader as the runtime's (:mod:`hpc_ddp.runtime.configfile`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hpc_ddp import HpcDdpError
from hpc_ddp.runtime import configfile
from hpc_ddp.runtime.config import (
    CheckpointConfig,
    ChecksConfig,
    DistConfig,
    MonitorConfig,
    PreemptConfig,
    RunConfig,
    RuntimeConfig,
    TrackingConfig,
)
from hpc_ddp.runtime.configfile import require, section, setting


def require_factory_for_custom(section: str, kind: str, factory: str | None) -> None:
    """A factory exactly when ``section``'s kind is custom: one set for another kind would be
    ignored without a word."""
    if kind == "custom" and not factory:
        raise HpcDdpError(
            f"{section}.kind=custom needs {section}.factory",
            f"set {section}.factory=pkg.module:function",
        )
    if kind != "custom" and factory:
        raise HpcDdpError(
            f"{section}.factory={factory!r} is set but {section}.kind={kind}: it would be ignored",
            f"set {section}.kind=custom to use the factory, or remove {section}.factory",
        )


@dataclass(frozen=True)
class DataConfig:
    """What to train on and how it is batched."""

    kind: Literal["digits", "synthetic", "parquet", "custom"] = setting(
        "digits",
        "digits: scikit-learn's bundled 8x8 digits (1797 real samples). synthetic: a "
        "deterministic separable problem of any size. parquet: files at train_path/val_path, "
        "sharded by row group so each rank reads only its share. custom: `factory` builds it.",
    )
    train_path: str | None = setting(
        None, "parquet: training data: a .parquet file, a directory of them, or a glob."
    )
    val_path: str | None = setting(None, "parquet: validation data, same forms as train_path.")
    feature_columns: list[str] | None = setting(
        None,
        "parquet: numeric feature columns, or one fixed-size list column; null: every column "
        "except label_column.",
    )
    label_column: str = setting("label", "parquet: the integer class label column.")
    factory: str | None = setting(
        None,
        "For kind=custom: 'pkg.module:function' called as function(config, seed) and returning "
        "(train_dataset, val_dataset, num_features, num_classes).",
    )
    batch_size: int = setting(
        128,
        "GLOBAL batch size: samples per optimizer step summed over all ranks and micro-steps. "
        "Each rank loads batch_size / (world_size * train.grad_accum_steps) per micro-step.",
    )
    val_fraction: float = setting(0.2, "digits: share of the samples held out for validation.")
    num_samples: int = setting(8192, "synthetic: training samples.")
    num_val_samples: int = setting(1001, "synthetic: validation samples.")
    num_features: int = setting(64, "synthetic: input features.")
    num_classes: int = setting(10, "synthetic and parquet: number of classes (labels 0..n-1).")
    num_workers: int | Literal["auto"] = setting(
        0,
        "DataLoader worker processes per rank. auto: the CPUs Slurm gave the task (or this "
        "machine's CPUs shared among the local ranks) minus one for the training process.",
    )

    def __post_init__(self) -> None:
        require(self.batch_size > 0, "data.batch_size", self.batch_size, "a positive integer")
        require(0 < self.val_fraction < 1, "data.val_fraction", self.val_fraction, "0 < x < 1")
        for key in ("num_samples", "num_val_samples", "num_features"):
            value = getattr(self, key)
            require(value > 0, f"data.{key}", value, "a positive integer")
        require(self.num_classes >= 2, "data.num_classes", self.num_classes, "at least 2")
        if self.num_workers != "auto":
            require(self.num_workers >= 0, "data.num_workers", self.num_workers, ">= 0 or auto")
        require_factory_for_custom("data", self.kind, self.factory)
        if self.kind == "parquet" and not (self.train_path and self.val_path):
            raise HpcDdpError(
                "data.kind=parquet needs data.train_path and data.val_path",
                "write a set with `hpc-ddp data make --kind synthetic --rows 100000 "
                "--row-group-size 4096 --out data/synth`, then pass "
                "data.train_path=data/synth/train data.val_path=data/synth/val",
            )


@dataclass(frozen=True)
class ModelConfig:
    """The network."""

    kind: Literal["mlp", "custom"] = setting(
        "mlp", "mlp: a ReLU multilayer perceptron. custom: `factory` builds it."
    )
    factory: str | None = setting(
        None,
        "For kind=custom: 'pkg.module:function' called as function(config, num_features, "
        "num_classes) and returning a torch.nn.Module that maps a batch of features to logits.",
    )
    hidden_sizes: list[int] = setting([256, 256], "mlp: widths of the hidden layers.")
    dropout: float = setting(0.0, "mlp: dropout probability after each hidden layer.")
    stages: int = setting(
        1,
        "mlp: split the layers into this many consecutive stages, stage i on the rank's "
        "device i (model parallel inside the rank, DDP across ranks; set dist.gpus_per_rank "
        "to the same number on GPUs). 1: one piece.",
    )

    def __post_init__(self) -> None:
        require(
            all(size > 0 for size in self.hidden_sizes),
            "model.hidden_sizes",
            self.hidden_sizes,
            "positive widths",
        )
        require(0 <= self.dropout < 1, "model.dropout", self.dropout, "0 <= x < 1")
        layers = len(self.hidden_sizes) + 1
        require(1 <= self.stages <= layers, "model.stages", self.stages, f"1 to {layers}")
        require_factory_for_custom("model", self.kind, self.factory)


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    name: Literal["sgd", "adamw"] = setting("sgd", "Optimizer.")
    lr: float = setting(0.1, "Peak learning rate (reached after warmup).")
    momentum: float = setting(0.9, "sgd: momentum.")
    weight_decay: float = setting(0.0, "Weight decay (decoupled for adamw).")
    schedule: Literal["constant", "cosine", "linear"] = setting(
        "constant", "Learning-rate shape after warmup, over all optimizer steps of the run."
    )
    warmup_steps: int = setting(0, "Optimizer steps of linear warmup from 0 to lr.")
    grad_clip_norm: float | None = setting(
        None, "Clip the global gradient norm to this value; null turns clipping off."
    )

    def __post_init__(self) -> None:
        require(0 < self.lr < math.inf, "optim.lr", self.lr, "a positive finite number")
        require(0 <= self.momentum < 1, "optim.momentum", self.momentum, "0 <= x < 1")
        require(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, ">= 0")
        require(0 <= self.weight_decay < math.inf, "optim.weight_decay", self.weight_decay, ">= 0")
        if self.grad_clip_norm is not None:
            require(self.grad_clip_norm > 0, "optim.grad_clip_norm", self.grad_clip_norm, "> 0")


@dataclass(frozen=True)
class TrainConfig:
    """The training loop."""

    epochs: int = setting(5, "Passes over the training set.")
    grad_accum_steps: int = setting(
        1, "Micro-steps per optimizer step; gradients are all-reduced only on the last one."
    )
    precision: Literal["fp32", "bf16"] = setting(
        "fp32", "bf16 runs forward and loss under bfloat16 autocast; weights stay fp32."
    )
    log_interval: int | None = setting(
        None,
        "Optimizer steps between progress lines and per-interval metrics. null: about every "
        "5 s of training (rank 0 times the first 20 steps and all ranks adopt its count), so "
        "small fast models do not pay a log line and a reduction every few milliseconds.",
    )
    train_accuracy: bool = setting(
        False,
        "Also count correct predictions (argmax) on the training batches and log "
        "train_accuracy. Off by default: it adds four kernels to every micro-batch (its "
        "measured cost is in bench/README.md). Validation accuracy is always computed, exactly.",
    )
    max_steps: int | None = setting(
        None, "Stop after this many optimizer steps (smoke tests); null: run all epochs."
    )

    def __post_init__(self) -> None:
        require(self.epochs > 0, "train.epochs", self.epochs, "a positive integer")
        require(self.grad_accum_steps > 0, "train.grad_accum_steps", self.grad_accum_steps, "> 0")
        if self.log_interval is not None:
            require(self.log_interval > 0, "train.log_interval", self.log_interval, "> 0 or null")
        if self.max_steps is not None:
            require(self.max_steps > 0, "train.max_steps", self.max_steps, "> 0 or null")


@dataclass(frozen=True)
class Config:
    """A whole run of the built-in trainer."""

    run: RunConfig = section(lambda: RunConfig(name="digits-mlp"), "Identity and output.")
    data: DataConfig = section(DataConfig, "Data.")
    model: ModelConfig = section(ModelConfig, "Model.")
    optim: OptimConfig = section(OptimConfig, "Optimizer.")
    train: TrainConfig = section(TrainConfig, "Training loop.")
    dist: DistConfig = section(DistConfig, "Distribution.")
    tracking: TrackingConfig = section(TrackingConfig, "MLflow tracking.")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "Checkpoints and resume.")
    preempt: PreemptConfig = section(PreemptConfig, "Preemption and requeue.")
    checks: ChecksConfig = section(ChecksConfig, "Checks before the first step.")
    monitor: MonitorConfig = section(MonitorConfig, "Where the run's time goes.")

    @property
    def runtime(self) -> RuntimeConfig:
        """The sections the runtime library takes."""
        return RuntimeConfig(
            **{name: getattr(self, name) for name in configfile.section_names(RuntimeConfig)}
        )

    def trainer_sections(self) -> dict[str, Any]:
        """data, model, optim and train, flattened: the trainer's own MLflow params."""
        return {
            key: value
            for key, value in configfile.flatten(self).items()
            if key.split(".", 1)[0] in ("data", "model", "optim", "train")
        }


#: Config keys that may change between attempts without breaking a resume.
RESUME_SAFE_PREFIXES = (
    "train.epochs",
    "train.log_interval",
    "train.max_steps",
    # Every runtime section but run: where and how a run goes, never what it computes.
    *(f"{name}." for name in configfile.section_names(RuntimeConfig) if name != "run"),
    "run.output_dir",
    "run.id",
    "run.name",
    "data.num_workers",
)


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Load ``path`` (or the defaults when None) and apply dotted ``key=value`` overrides."""
    return configfile.load(Config, path, overrides)


def config_docs() -> list[tuple[str, str, str]]:
    """(dotted key, default, doc) for every field: the reference that `hpc-ddp config` prints."""
    return configfile.docs(Config)


def resume_fingerprint(config: Config) -> dict[str, Any]:
    """The config values a resume depends on (model shape, data, optimizer, batch, seed)."""
    return {
        key: value
        for key, value in sorted(configfile.flatten(config).items())
        if not key.startswith(RESUME_SAFE_PREFIXES)
    }
