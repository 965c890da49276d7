"""Parquet training data, sharded by row group: each rank opens and reads only its share.

Every epoch the row groups are put in a seeded order (the same on every rank) and seen as one
virtual sequence of rows. Training splits it into W equal contiguous shares of
``total // W`` rows, so every rank runs the same number of steps; the last ``total % W``
rows of the epoch's order (fewer than W) sit out that epoch, and the reshuffle lets other
rows sit out the next. Validation splits all rows, the first ``total % W`` ranks taking one
more, so every row is counted exactly once. A rank reads only the row groups that overlap
its share (at most two of them shared with a neighbour), one at a time.

Within a row group, rows are permuted with a seed of (seed, epoch, group), the same on every
rank, before the share is cut. DataLoader workers take a rank's segments round-robin; the
loader yields them in segment order whatever the worker count, and a main-process rebatcher
cuts exact micro-batches. Columns become tensors column by column, never row by row.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from hpc_ddp.trainer.parquetfiles import (
    RowGroup,
    columns_to_numpy,
    feature_columns_of,
    open_parquet,
    read_row_groups,
)


@dataclass(frozen=True)
class Segment:
    """Rows [start, stop) of a row group, counted in the group's permuted order."""

    group: RowGroup
    start: int
    stop: int

    @property
    def num_rows(self) -> int:
        return self.stop - self.start


def _generator(seed: int, epoch: int, salt: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, salt])


def epoch_order(groups: list[RowGroup], seed: int, epoch: int, shuffle: bool) -> list[RowGroup]:
    """The epoch's group order: a seeded permutation, identical on every rank."""
    if not shuffle:
        return list(groups)
    order = _generator(seed, epoch, 0).permutation(len(groups))
    return [groups[i] for i in order]


def row_permutation(group: RowGroup, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(group.num_rows)
    permutation: np.ndarray = _generator(seed, epoch, group.key + 1).permutation(group.num_rows)
    return permutation


def share_bounds(total: int, rank: int, world_size: int, equal: bool) -> tuple[int, int]:
    """[begin, end) of a rank's share of ``total`` rows (see the module docstring)."""
    if equal:
        share = total // world_size
        return rank * share, (rank + 1) * share
    base, extra = divmod(total, world_size)
    begin = rank * base + min(rank, extra)
    return begin, begin + base + (1 if rank < extra else 0)


def shard(groups: list[RowGroup], begin: int, end: int) -> list[Segment]:
    """The pieces of ``groups`` (in this order) covering rows [begin, end) of their sequence."""
    segments = []
    offset = 0
    for group in groups:
        low, high = max(begin, offset), min(end, offset + group.num_rows)
        if low < high:
            segments.append(Segment(group, low - offset, high - offset))
        offset += group.num_rows
        if offset >= end:
            break
    return segments


def skip_rows(segments: list[Segment], skip: int) -> list[Segment]:
    """Drop the first ``skip`` rows without reading them (mid-epoch resume)."""
    kept = []
    for segment in segments:
        if skip >= segment.num_rows:
            skip -= segment.num_rows
            continue
        kept.append(Segment(segment.group, segment.start + skip, segment.stop))
        skip = 0
    return kept


class ParquetShard(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """One rank's rows of a Parquet set, yielded as one (features, labels) chunk per segment."""

    def __init__(
        self,
        spec: str,
        feature_columns: list[str] | None,
        label_column: str,
        rank: int,
        world_size: int,
        seed: int,
        training: bool,
    ) -> None:
        self.features = feature_columns or feature_columns_of(spec, label_column)
        self.label = label_column
        self.groups = read_row_groups(spec, [*self.features, self.label])
        self.rank, self.world_size, self.seed, self.training = rank, world_size, seed, training
        self.epoch = 0
        self.skip = 0
        self.bytes_read = 0

    @property
    def total_rows(self) -> int:
        return sum(group.num_rows for group in self.groups)

    @property
    def num_features(self) -> int:
        if len(self.features) == 1:
            field = open_parquet(self.groups[0].path).schema_arrow.field(self.features[0])
            if hasattr(field.type, "list_size"):
                return int(field.type.list_size)
        return len(self.features)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_start(self, skip: int) -> None:
        self.skip = skip

    def segments(self) -> list[Segment]:
        """This rank's pieces for the current epoch, after the resume skip."""
        order = epoch_order(self.groups, self.seed, self.epoch, shuffle=self.training)
        begin, end = share_bounds(self.total_rows, self.rank, self.world_size, equal=self.training)
        return skip_rows(shard(order, begin, end), self.skip)

    def num_rows(self) -> int:
        return sum(segment.num_rows for segment in self.segments())

    def read(self, segment: Segment) -> tuple[torch.Tensor, torch.Tensor]:
        table = open_parquet(segment.group.path).read_row_group(
            segment.group.index, columns=[*self.features, self.label]
        )
        self.bytes_read += table.nbytes
        rows = row_permutation(segment.group, self.seed, self.epoch, self.training)
        rows = rows[segment.start : segment.stop]
        features = columns_to_numpy(table, self.features)[rows]
        labels = table.column(self.label).to_numpy().astype(np.int64, copy=False)[rows]
        return torch.from_numpy(np.ascontiguousarray(features)), torch.from_numpy(labels)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        worker = get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker else (0, 1)
        for position, segment in enumerate(self.segments()):
            if position % num_workers == worker_id:
                yield self.read(segment)


class ParquetLoader:
    """Exact micro-batches from a ParquetShard: ``len()`` is the same on every rank in training
    (equal shares), and the last partial batch is dropped in training, kept in evaluation."""

    def __init__(
        self, shard: ParquetShard, batch_size: int, num_workers: int, pin_memory: bool
    ) -> None:
        self.shard = shard
        self.batch_size = batch_size
        self.loader: DataLoader[Any] = DataLoader(
            shard,
            batch_size=None,
            num_workers=num_workers,
            pin_memory=pin_memory,
            persistent_workers=False,
            prefetch_factor=2 if num_workers else None,
        )

    def set_epoch(self, epoch: int) -> None:
        self.shard.set_epoch(epoch)

    def set_start(self, skip: int) -> None:
        self.shard.set_start(skip)

    def __len__(self) -> int:
        rows = self.shard.num_rows()
        if self.shard.training:
            return rows // self.batch_size
        return -(-rows // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        pending_x: list[torch.Tensor] = []
        pending_y: list[torch.Tensor] = []
        held = 0
        for features, labels in self.loader:
            pending_x.append(features)
            pending_y.append(labels)
            held += len(labels)
            if held < self.batch_size:
                continue
            all_x, all_y = torch.cat(pending_x), torch.cat(pending_y)
            full = (held // self.batch_size) * self.batch_size
            batches_x = all_x[:full].split(self.batch_size)
            yield from zip(batches_x, all_y[:full].split(self.batch_size), strict=True)
            pending_x, pending_y, held = [all_x[full:]], [all_y[full:]], held - full
        if held and not self.shard.training:
            yield torch.cat(pending_x), torch.cat(pending_y)
