"""A Parquet set's files as the built-in trainer reads them: which files a path names, their
row groups (metadata only), the checks their columns must pass before training, and a row
group's columns as one array."""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpc_ddp import HpcDdpError


@dataclass(frozen=True)
class RowGroup:
    """One row group of one file; ``key`` is its position in the sorted list of all groups."""

    path: str
    index: int
    num_rows: int
    key: int


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
