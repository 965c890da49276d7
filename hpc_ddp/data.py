"""Datasets and the per-rank loaders: DistributedSampler for training, exact sharding for eval."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from hpc_ddp.config import Config
from hpc_ddp.errors import HpcDdpError
from hpc_ddp.models import load_factory
from hpc_ddp.parquet import ParquetLoader, ParquetShard


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
    val.shard(0, 1, config.run.seed, training=False)  # fails early on bad paths or columns
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
    result = load_factory(str(data.factory), "data.factory")(config, config.run.seed)
    if not (isinstance(result, tuple) and len(result) == 4):
        raise HpcDdpError(
            f"data.factory={data.factory!r} returned {type(result).__name__}",
            "return (train_dataset, val_dataset, num_features, num_classes)",
        )
    return Datasets(*result)


class ShardedEvalSampler(Sampler[int]):
    """Rank r takes indices r, r+W, r+2W, ...: every sample exactly once over all ranks.

    Unlike DistributedSampler it neither pads with duplicates nor drops a tail, so shards
    may differ in length by one; evaluation sums and counts, so that is exact.
    """

    def __init__(self, dataset_size: int, rank: int, world_size: int) -> None:
        self.dataset_size = dataset_size
        self.rank = rank
        self.world_size = world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.dataset_size, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.dataset_size, self.world_size))


class ResumableDistributedSampler(DistributedSampler[Any]):
    """DistributedSampler that can start an epoch part-way, without touching the skipped
    samples: the order is DistributedSampler's (seed + epoch), minus the first ``skip``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skip = 0

    def set_start(self, skip: int) -> None:
        """Skip this rank's first ``skip`` samples of the current epoch (0: whole epoch)."""
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        if not self.skip:
            return super().__iter__()
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return max(0, super().__len__() - self.skip)


def _worker_kwargs(num_workers: int) -> dict[str, Any]:
    if num_workers == 0:
        return {}
    return {"persistent_workers": True, "prefetch_factor": 4}


def train_loader(
    dataset: Dataset[Any] | ParquetSource,
    rank: int,
    world_size: int,
    micro_batch_size: int,
    seed: int,
    num_workers: int,
    pin_memory: bool,
) -> tuple[Any, ResumableDistributedSampler | ParquetLoader]:
    """Shuffled, sharded micro-batches of full size only (drop_last), so every global batch
    holds exactly ``data.batch_size`` samples whatever the world size.

    Returns the loader and what positions it (``set_epoch``, ``set_start``).
    """
    if isinstance(dataset, ParquetSource):
        parquet = ParquetLoader(
            dataset.shard(rank, world_size, seed, training=True),
            micro_batch_size,
            num_workers,
            pin_memory,
        )
        return parquet, parquet
    sampler = ResumableDistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
    )
    loader = DataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=num_workers,
        pin_memory=pin_memory,
        **_worker_kwargs(num_workers),
    )
    return loader, sampler


def eval_loader(
    dataset: Dataset[Any] | ParquetSource,
    rank: int,
    world_size: int,
    batch_size: int,
    num_workers: int,
    pin_memory: bool,
) -> Any:
    """Every validation sample once across ranks (see ShardedEvalSampler)."""
    if isinstance(dataset, ParquetSource):
        return ParquetLoader(
            dataset.shard(rank, world_size, 0, training=False), batch_size, num_workers, pin_memory
        )
    size = len(dataset)  # type: ignore[arg-type]
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=ShardedEvalSampler(size, rank, world_size),
        num_workers=num_workers,
        pin_memory=pin_memory,
        **_worker_kwargs(num_workers),
    )
