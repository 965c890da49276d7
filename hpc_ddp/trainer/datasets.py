"""The built-in trainer's data: scikit-learn's digits, a synthetic problem, Parquet files,
or a user's factory; each a (features, label) classification set."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset

from hpc_ddp import HpcDdpError
from hpc_ddp.trainer.config import Config
from hpc_ddp.trainer.models import call_factory
from hpc_ddp.trainer.parquet import ParquetLoader, ParquetShard
from hpc_ddp.trainer.parquetfiles import check_columns


@dataclass(frozen=True)
class ParquetSource:
    """Parquet data, opened per rank by the loaders (see hpc_ddp.parquet)."""

    spec: str
    feature_columns: list[str] | None
    label_column: str

    def shard(self, rank: int, world_size: int, seed: int, training: bool) -> ParquetShard:
        return ParquetShard(
            self.spec, self.feature_columns, self.label_column, rank, world_size, seed, training
        )


@dataclass(frozen=True)
class Datasets:
    """Train and validation sets with the shapes the model needs."""

    train: Dataset[Any] | ParquetSource
    val: Dataset[Any] | ParquetSource
    num_features: int
    num_classes: int

    def sizes(self) -> tuple[int, int]:
        """(train rows, validation rows)."""
        return _size(self.train), _size(self.val)

    def first_features(self) -> torch.Tensor:
        """One validation example's features, for a dry run."""
        if isinstance(self.val, ParquetSource):
            shard = self.val.shard(0, 1, 0, training=False)
            return shard.read(shard.segments()[0])[0][0]
        return self.val[0][0]  # type: ignore[no-any-return]


def _size(dataset: Dataset[Any] | ParquetSource) -> int:
    if isinstance(dataset, ParquetSource):
        return dataset.shard(0, 1, 0, training=False).total_rows
    return len(dataset)  # type: ignore[arg-type]


def parquet_datasets(config: Config) -> Datasets:
    """Parquet files (metadata is read and the columns checked here, data later per rank)."""
    data = config.data
    train = ParquetSource(str(data.train_path), data.feature_columns, data.label_column)
    val = ParquetSource(str(data.val_path), data.feature_columns, data.label_column)
    probe = train.shard(0, 1, config.run.seed, training=True)
    val_probe = val.shard(0, 1, config.run.seed, training=False)  # bad paths or columns
    for source, shard in ((train, probe), (val, val_probe)):
        check_columns(source.spec, shard.features, source.label_column, data.num_classes)
    return Datasets(train, val, probe.num_features, data.num_classes)


DIGITS_MAX_PIXEL = 16.0


def digits_datasets(val_fraction: float, seed: int) -> Datasets:
    """scikit-learn's bundled 8x8 digits (1797 samples), split by a seeded permutation."""
    from sklearn.datasets import load_digits  # only this dataset pays the import

    bunch = load_digits()
    features = torch.tensor(bunch.data, dtype=torch.float32)
    labels = torch.tensor(bunch.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    num_val = max(1, round(len(labels) * val_fraction))
    val_idx, train_idx = order[:num_val], order[num_val:]
    # Pixel intensities are 0..16; scaling (not standardising) keeps pixels that are constant
    # in the training split from blowing up in validation.
    features = features / DIGITS_MAX_PIXEL
    return Datasets(
        TensorDataset(features[train_idx], labels[train_idx]),
        TensorDataset(features[val_idx], labels[val_idx]),
        64,
        10,
    )


def synthetic_datasets(
    num_samples: int, num_val_samples: int, num_features: int, num_classes: int, seed: int
) -> Datasets:
    """A deterministic, learnable problem: labels from a fixed random linear teacher."""
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(num_features, num_classes, generator=generator)
    features = torch.randn(num_samples + num_val_samples, num_features, generator=generator)
    labels = (features @ teacher).argmax(dim=1)
    return Datasets(
        TensorDataset(features[:num_samples], labels[:num_samples]),
        TensorDataset(features[num_samples:], labels[num_samples:]),
        num_features,
        num_classes,
    )


def build_datasets(config: Config) -> Datasets:
    """The datasets the config asks for; identical on every rank."""
    data = config.data
    if data.kind == "digits":
        return digits_datasets(data.val_fraction, config.run.seed)
    if data.kind == "parquet":
        return parquet_datasets(config)
    if data.kind == "synthetic":
        return synthetic_datasets(
            data.num_samples,
            data.num_val_samples,
            data.num_features,
            data.num_classes,
            config.run.seed,
        )
    result = call_factory(
        str(data.factory), "data.factory", (config, config.run.seed), DATA_CONTRACT
    )
    problem = _contract_problem(result)
    if problem:
        raise HpcDdpError(
            f"data.factory={data.factory!r} returned {problem}", f"define it as: {DATA_CONTRACT}"
        )
    return Datasets(*result)


DATA_CONTRACT = (
    "def build(config, seed) -> (train_dataset, val_dataset, num_features, num_classes), "
    "datasets of (features tensor, label) samples with len(), num_classes >= 2"
)


def _contract_problem(result: Any) -> str | None:
    """What is wrong with a data factory's result, or None."""
    if not (isinstance(result, tuple) and len(result) == 4):
        length = f" of {len(result)}" if isinstance(result, tuple) else ""
        return f"{type(result).__name__}{length}, not a tuple of 4"
    for name, dataset in zip(("train_dataset", "val_dataset"), result[:2], strict=True):
        if isinstance(dataset, str | bytes) or not (
            hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
        ):
            return f"{type(dataset).__name__} as {name}: not a map-style dataset"
    for name, value, least in (("num_features", result[2], 1), ("num_classes", result[3], 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            return f"{name}={value!r}: expected an integer >= {least}"
    return None


class ParquetTrainLoader(ParquetLoader):
    """A rank's training micro-batches of a Parquet set, positioned by optimizer step for
    :meth:`hpc_ddp.Run.steps` (mid-epoch, the consumed rows are skipped without reading
    them); batches arrive on ``device``."""

    def __init__(
        self,
        shard: ParquetShard,
        micro_batch_size: int,
        grad_accum_steps: int,
        global_batch_size: int,
        num_workers: int,
        device: torch.device,
    ) -> None:
        super().__init__(shard, micro_batch_size, num_workers, pin_memory=device.type == "cuda")
        self.grad_accum_steps = grad_accum_steps
        self.global_batch_size = global_batch_size
        self.device = device
        self.steps_per_epoch = len(self) // grad_accum_steps

    def set_position(self, epoch: int, step: int) -> None:
        self.set_epoch(epoch)
        self.set_start(step * self.grad_accum_steps * self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for features, labels in super().__iter__():
            if self.device.type == "cpu":
                yield features, labels
            else:
                yield (
                    features.to(self.device, non_blocking=True),
                    labels.to(self.device, non_blocking=True),
                )
