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

import glob
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from hpc_ddp import HpcDdpError


@dataclass(frozen=True)
class RowGroup:
    """One row group of one file; ``key`` is its position in the sorted list of all groups."""

    path: str
    index: int
    num_rows: int
    key: int


@dataclass(frozen=True)
class Segment:
    """Rows [start, stop) of a row group, counted in the group's permuted order."""

    group: RowGroup
    start: int
    stop: int

    @property
    def num_rows(self) -> int:
        return self.stop - self.start


def discover_files(spec: str) -> list[Path]:
    """A file, a directory of *.parquet files, or a glob; sorted, never empty."""
    path = Path(spec)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(path.rglob("*.parquet"))
    else:
        files = sorted(Path(match) for match in glob.glob(spec, recursive=True))
    if not files:
        raise HpcDdpError(
            f"no Parquet files at {spec!r}",
            "point data.train_path/data.val_path at a .parquet file, a directory holding "
            "some, or a glob such as 'data/train-*.parquet' (hpc-ddp data make writes a set)",
        )
    return files


def open_parquet(path: str | Path) -> Any:
    """pyarrow's ParquetFile, with an error that names the file when it is not Parquet."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises several types for a file that is not Parquet
        raise HpcDdpError(
            f"cannot read Parquet file {path}: {error}", "check the path; rewrite the file"
        ) from None


def read_row_groups(spec: str, columns: list[str]) -> list[RowGroup]:
    """Row groups of every file (metadata only), checking that ``columns`` exist in each."""
    groups: list[RowGroup] = []
    for path in discover_files(spec):
        metadata = open_parquet(path).metadata
        names = metadata.schema.names
        missing = [column for column in columns if column not in names]
        if missing:
            raise HpcDdpError(
                f"{path} has no column(s) {missing}",
                f"valid columns: {', '.join(names)}; set data.feature_columns / data.label_column",
            )
        for index in range(metadata.num_row_groups):
            rows = metadata.row_group(index).num_rows
            if rows:
                groups.append(RowGroup(str(path), index, rows, len(groups)))
    return groups


def feature_columns_of(spec: str, label_column: str) -> list[str]:
    """All columns of the first file except the label."""
    names = open_parquet(discover_files(spec)[0]).schema_arrow.names
    if label_column not in names:
        raise HpcDdpError(
            f"{discover_files(spec)[0]} has no label column {label_column!r}",
            f"valid columns: {', '.join(names)}; set data.label_column",
        )
    return [name for name in names if name != label_column]


def check_columns(spec: str, features: list[str], label: str, num_classes: int) -> None:
    """Refuse, from the files' metadata alone, what training could only fail on later: no
    feature column, features that are not numbers, labels that are not integers or fall
    outside 0..num_classes-1 (by the row groups' statistics), no rows at all."""
    import pyarrow as pa

    if not features:
        raise HpcDdpError(
            f"{spec!r} has no feature column: its only column is the label {label!r}",
            "point data.train_path/data.val_path at files with feature columns, or set "
            "data.feature_columns",
        )

    def numeric(kind: Any) -> bool:
        return bool(pa.types.is_integer(kind) or pa.types.is_floating(kind))

    rows = 0
    for path in discover_files(spec):
        parquet = open_parquet(path)
        schema = parquet.schema_arrow
        for name in features:
            kind = schema.field(name).type
            listed = pa.types.is_fixed_size_list(kind) and numeric(kind.value_type)
            if not (numeric(kind) or listed):
                raise HpcDdpError(
                    f"{path}: feature column {name!r} holds {kind}, not numbers",
                    "encode it as numbers, or leave it out with data.feature_columns=[...]",
                )
        if not pa.types.is_integer(schema.field(label).type):
            raise HpcDdpError(
                f"{path}: label column {label!r} holds {schema.field(label).type}, expected "
                f"integer class ids 0..{num_classes - 1}",
                "encode the labels as integers, or set data.label_column",
            )
        metadata = parquet.metadata
        index = metadata.schema.names.index(label)
        rows += metadata.num_rows
        for group in range(metadata.num_row_groups):
            stats = metadata.row_group(group).column(index).statistics
            if stats is None or not stats.has_min_max:
                continue
            if stats.min < 0 or stats.max >= num_classes:
                bad = stats.min if stats.min < 0 else stats.max
                raise HpcDdpError(
                    f"{path}: label {bad} in column {label!r} is outside 0..{num_classes - 1} "
                    f"(data.num_classes={num_classes})",
                    "set data.num_classes to the number of classes, or fix the labels",
                )
    if rows == 0:
        raise HpcDdpError(
            f"{spec!r} has no rows", "point data.train_path/data.val_path at files with data"
        )


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


def columns_to_numpy(table: Any, columns: list[str]) -> np.ndarray:
    """(rows, features) float32, column by column; a single list column is unpacked whole."""
    import pyarrow as pa

    if len(columns) == 1 and pa.types.is_fixed_size_list(table.schema.field(columns[0]).type):
        column = table.column(columns[0]).combine_chunks()
        width = column.type.list_size
        values: np.ndarray = column.flatten().to_numpy().astype(np.float32).reshape(-1, width)
        return values
    return np.stack(
        [table.column(name).to_numpy().astype(np.float32, copy=False) for name in columns], axis=1
    )


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
