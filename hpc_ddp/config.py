"""Typed run configuration: dataclasses loaded from YAML, strict, with dotted overrides.

``load_config("configs/digits.yaml", ["train.epochs=3", "data.batch_size=128"])``. Unknown
sections and keys, wrong types and bad values are refused with a message that names the
file, the key and what is valid.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from hpc_ddp.errors import HpcDdpError


def setting(default: Any, doc: str) -> Any:
    """A dataclass field with its documentation attached (shown by `hpc-ddp config --docs`)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


def _require(condition: bool, key: str, seen: object, expected: str) -> None:
    if not condition:
        raise HpcDdpError(f"{key}={seen!r} is invalid: expected {expected}", f"fix {key}")


@dataclass(frozen=True)
class RunConfig:
    """Identity of the run and where it writes."""

    name: str = setting(
        "digits-mlp", "Run name: the MLflow run name and a folder under output_dir."
    )
    output_dir: str = setting(
        "runs", "Root folder for run directories and the default MLflow store (relative to cwd)."
    )
    seed: int = setting(
        0, "Seed for model initialisation and data order; ranks derive theirs from it."
    )
    id: str | None = setting(
        None,
        "Run directory name under output_dir/name. Default: the Slurm job id (stable across "
        "requeues), the local launcher's run id, or a timestamp.",
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
        _require(self.batch_size > 0, "data.batch_size", self.batch_size, "a positive integer")
        _require(0 < self.val_fraction < 1, "data.val_fraction", self.val_fraction, "0 < x < 1")
        for key in ("num_samples", "num_val_samples", "num_features", "num_classes"):
            value = getattr(self, key)
            _require(value > 0, f"data.{key}", value, "a positive integer")
        if self.num_workers != "auto":
            _require(self.num_workers >= 0, "data.num_workers", self.num_workers, ">= 0 or auto")
        if self.kind == "custom" and not self.factory:
            raise HpcDdpError(
                "data.kind=custom needs data.factory", "set data.factory=pkg.module:function"
            )
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

    def __post_init__(self) -> None:
        _require(
            all(size > 0 for size in self.hidden_sizes),
            "model.hidden_sizes",
            self.hidden_sizes,
            "positive widths",
        )
        _require(0 <= self.dropout < 1, "model.dropout", self.dropout, "0 <= x < 1")
        if self.kind == "custom" and not self.factory:
            raise HpcDdpError(
                "model.kind=custom needs model.factory", "set model.factory=pkg.module:function"
            )


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
        _require(self.lr > 0, "optim.lr", self.lr, "a positive number")
        _require(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, ">= 0")
        _require(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, ">= 0")
        if self.grad_clip_norm is not None:
            _require(self.grad_clip_norm > 0, "optim.grad_clip_norm", self.grad_clip_norm, "> 0")


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
        _require(self.epochs > 0, "train.epochs", self.epochs, "a positive integer")
        _require(self.grad_accum_steps > 0, "train.grad_accum_steps", self.grad_accum_steps, "> 0")
        if self.log_interval is not None:
            _require(self.log_interval > 0, "train.log_interval", self.log_interval, "> 0 or null")
        if self.max_steps is not None:
            _require(self.max_steps > 0, "train.max_steps", self.max_steps, "> 0 or null")


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
    master_port: int | None = setting(
        None,
        "Rendezvous port; wins over MASTER_PORT and over the port derived from the Slurm "
        "job id (10000-29999).",
    )

    def __post_init__(self) -> None:
        _require(self.init_timeout_s > 0, "dist.init_timeout_s", self.init_timeout_s, "> 0")
        _require(self.timeout_s > 0, "dist.timeout_s", self.timeout_s, "> 0")
        if self.master_port is not None:
            _require(0 < self.master_port < 65536, "dist.master_port", self.master_port, "1-65535")
        if self.backend == "nccl" and self.device == "cpu":
            raise HpcDdpError(
                "dist.backend=nccl cannot run with dist.device=cpu",
                "use dist.backend=gloo (or auto) on CPU",
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
    resume: bool = setting(
        True,
        "Resume from the newest loadable checkpoint of this run directory on start (a requeued "
        "Slurm job keeps its job id, so it finds its own checkpoints).",
    )

    def __post_init__(self) -> None:
        if self.every_steps is not None:
            _require(self.every_steps > 0, "checkpoint.every_steps", self.every_steps, "> 0")
        if self.every_minutes is not None:
            _require(self.every_minutes > 0, "checkpoint.every_minutes", self.every_minutes, "> 0")
        _require(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, ">= 1")


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
    check_every_steps: int | None = setting(
        None,
        "Optimizer steps between the ranks' agreement on stop signals (and time-based saves); "
        "a stop lands within two such periods of the signal. null: about once per second of "
        "training, measured on rank 0 and agreed by all ranks at the first log interval "
        "(every step until then).",
    )

    def __post_init__(self) -> None:
        _require(self.max_requeues >= 0, "preempt.max_requeues", self.max_requeues, ">= 0")
        if self.check_every_steps is not None:
            _require(
                self.check_every_steps >= 1,
                "preempt.check_every_steps",
                self.check_every_steps,
                ">= 1 or null",
            )
        _require(
            self.requeue_timeout_s > 0, "preempt.requeue_timeout_s", self.requeue_timeout_s, "> 0"
        )


@dataclass(frozen=True)
class Config:
    """A whole run."""

    run: RunConfig = field(default_factory=RunConfig, metadata={"doc": "Identity and output."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"doc": "Data."})
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"doc": "Model."})
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"doc": "Optimizer."})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"doc": "Training loop."})
    dist: DistConfig = field(default_factory=DistConfig, metadata={"doc": "Distribution."})
    tracking: TrackingConfig = field(
        default_factory=TrackingConfig, metadata={"doc": "MLflow tracking."}
    )
    checkpoint: CheckpointConfig = field(
        default_factory=CheckpointConfig, metadata={"doc": "Checkpoints and resume."}
    )
    preempt: PreemptConfig = field(
        default_factory=PreemptConfig, metadata={"doc": "Preemption and requeue."}
    )


_SECTION_TYPES = typing.get_type_hints(Config)


_YAML_EXPONENT = re.compile(r"^[-+]?\d+(\.\d*)?[eE][-+]?\d+$")


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " | ".join(repr(choice) for choice in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(hint))
    if origin is list:
        return f"a list of {_describe(typing.get_args(hint)[0])}"
    if hint is type(None):
        return "null"
    return getattr(hint, "__name__", str(hint))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _coerce_scalar(value: Any, hint: Any) -> tuple[bool, Any]:
    """(matched, value) for None, bool, int, float and str; ints widen to float."""
    if hint is str and _is_int(value):
        return True, str(value)  # run.id=1234 (a Slurm job id) is read by YAML as a number
    if hint is type(None) or hint is bool or hint is str:
        return isinstance(value, hint), value
    if hint is int:
        return _is_int(value), value
    if hint is float:
        if _is_int(value) or isinstance(value, float):
            return True, float(value)
        # YAML 1.1 reads exponents without a dot (1e-3) as text; accept them as numbers.
        if isinstance(value, str) and _YAML_EXPONENT.match(value.strip()):
            return True, float(value)
    return False, value


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check ``value`` against a type hint and return it (ints widen to float)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _coerce(value, option, where)
            except HpcDdpError:
                continue
    elif origin is Literal:
        if value in typing.get_args(hint):
            return value
    elif origin is list:
        if isinstance(value, list):
            (item_hint,) = typing.get_args(hint)
            return [_coerce(item, item_hint, f"{where}[{i}]") for i, item in enumerate(value)]
    else:
        matched, coerced = _coerce_scalar(value, hint)
        if matched:
            return coerced
    raise HpcDdpError(
        f"{where}: got {value!r} ({type(value).__name__}), expected {_describe(hint)}"
    )


def _build_section(section: str, values: Any, source: str) -> Any:
    cls = _SECTION_TYPES[section]
    if not isinstance(values, dict):
        raise HpcDdpError(
            f"{source}: section '{section}' must be a mapping of keys to values, got {values!r}",
            f"write it as '{section}:' followed by indented 'key: value' lines",
        )
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise HpcDdpError(
            f"{source}: unknown key '{section}.{unknown[0]}'",
            f"valid keys in '{section}': {', '.join(valid)}",
        )
    try:
        coerced = {
            key: _coerce(value, hints[key], f"{section}.{key}") for key, value in values.items()
        }
        return cls(**coerced)
    except HpcDdpError as error:
        raise HpcDdpError(
            f"{source}: {error.message}", error.hint or "fix it in the YAML file or the override"
        ) from None


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> Config:
    """Build a Config from nested plain data, refusing anything it does not know."""
    unknown = sorted(set(raw) - set(_SECTION_TYPES))
    if unknown:
        raise HpcDdpError(
            f"{source}: unknown section '{unknown[0]}'",
            f"valid sections: {', '.join(_SECTION_TYPES)}",
        )
    sections = {name: _build_section(name, raw.get(name) or {}, source) for name in _SECTION_TYPES}
    return Config(**sections)


def parse_override(text: str) -> tuple[str, str, Any]:
    """Split 'section.key=value'; the value is read as YAML (3, 0.1, true, null, [64, 64])."""
    if "=" not in text:
        raise HpcDdpError(
            f"cannot read override {text!r}: expected section.key=value",
            "write overrides like train.epochs=3 data.batch_size=128",
        )
    dotted, _, raw_value = text.partition("=")
    section, dot, key = dotted.strip().partition(".")
    if not dot or not key or "." in key:
        raise HpcDdpError(
            f"cannot read override {text!r}: the key must be section.key",
            f"sections: {', '.join(_SECTION_TYPES)}; e.g. train.epochs=3",
        )
    try:
        value = yaml.safe_load(raw_value) if raw_value.strip() else ""
    except yaml.YAMLError:
        value = raw_value  # not YAML (e.g. a path with a backquote): keep it as text
    return section, key, value


def load_raw(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into nested plain data."""
    config_path = Path(path)
    if not config_path.is_file():
        raise HpcDdpError(
            f"config file {str(config_path)!r} does not exist",
            "pass --config with a path to a YAML file, e.g. configs/digits.yaml",
        )
    try:
        raw = yaml.safe_load(config_path.read_text()) or {}
    except yaml.YAMLError as error:
        raise HpcDdpError(f"{config_path}: not valid YAML: {error}") from None
    if not isinstance(raw, dict):
        raise HpcDdpError(
            f"{config_path}: expected a mapping of sections, got {type(raw).__name__}"
        )
    return raw


def load_config(path: str | Path | None, overrides: typing.Sequence[str] = ()) -> Config:
    """Load ``path`` (or the defaults when None) and apply dotted ``key=value`` overrides."""
    raw = load_raw(path) if path is not None else {}
    source = str(path) if path is not None else "<defaults>"
    for text in overrides:
        section, key, value = parse_override(text)
        if section not in _SECTION_TYPES:
            raise HpcDdpError(
                f"override {text!r}: unknown section '{section}'",
                f"valid sections: {', '.join(_SECTION_TYPES)}",
            )
        current = raw.setdefault(section, {})
        if not isinstance(current, dict):
            current = raw[section] = {}
        current[key] = value
        source = f"{source} + overrides" if "overrides" not in source else source
    return config_from_dict(raw, source)


def config_to_dict(config: Config) -> dict[str, Any]:
    """Nested plain data, the inverse of :func:`config_from_dict`."""
    return dataclasses.asdict(config)


def flatten(config: Config) -> dict[str, Any]:
    """``{"train.epochs": 5, ...}``: the form MLflow params and fingerprints use."""
    flat: dict[str, Any] = {}
    for section, values in config_to_dict(config).items():
        for key, value in values.items():
            flat[f"{section}.{key}"] = value
    return flat


def config_docs() -> list[tuple[str, str, str]]:
    """(dotted key, default, doc) for every field: the reference that `hpc-ddp config` prints."""
    rows = []
    for section, cls in _SECTION_TYPES.items():
        defaults = cls()
        for item in dataclasses.fields(cls):
            default = getattr(defaults, item.name)
            rows.append((f"{section}.{item.name}", repr(default), item.metadata.get("doc", "")))
    return rows
