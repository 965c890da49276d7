"""`hpc-ddp data make`: write a Parquet set (train/ and val/) for users and tests.

Columns f0..f<d-1> (float32) and `label` (int64), in row groups of a chosen size, spread
over a chosen number of files per split.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hpc_ddp import HpcDdpError


def _synthetic(rows: int, features: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    teacher = rng.standard_normal((features, classes)).astype(np.float32)
    x = rng.standard_normal((rows, features), dtype=np.float32)
    return x, (x @ teacher).argmax(axis=1).astype(np.int64)


def _digits(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1797 digits, shuffled and repeated to ``rows`` rows."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    order = np.random.default_rng(seed).permutation(len(bunch.target))
    take = np.resize(order, rows)
    return (bunch.data[take] / 16.0).astype(np.float32), bunch.target[take].astype(np.int64)


def write_split(
    features: np.ndarray, labels: np.ndarray, directory: Path, row_group_size: int, files: int
) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise HpcDdpError(
            f"cannot create {directory}: {error.strerror or error}",
            "pass --out a directory that can be created (not under a file)",
        ) from None
    written = []
    for index, rows in enumerate(np.array_split(np.arange(len(labels)), files)):
        if not len(rows):
            continue
        columns = {f"f{i}": features[rows, i] for i in range(features.shape[1])}
        columns["label"] = labels[rows]
        path = directory / f"part-{index:05d}.parquet"
        pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
        written.append(path)
    return written


def make_dataset(
    kind: str,
    rows: int,
    row_group_size: int,
    out: Path,
    val_rows: int | None = None,
    files: int = 1,
    num_features: int = 64,
    num_classes: int = 10,
    seed: int = 0,
) -> dict[str, list[Path]]:
    """Write <out>/train and <out>/val; returns the files written."""
    if rows < 1 or row_group_size < 1 or files < 1:
        raise HpcDdpError(
            f"rows={rows}, row_group_size={row_group_size}, files={files}: all must be >= 1",
            "e.g. --rows 100000 --row-group-size 4096",
        )
    validation = val_rows if val_rows is not None else max(1, rows // 10)
    total = rows + validation
    if kind == "synthetic":
        features, labels = _synthetic(total, num_features, num_classes, seed)
    elif kind == "digits":
        features, labels = _digits(total, seed)
    else:
        raise HpcDdpError(f"unknown kind {kind!r}", "choose synthetic or digits")
    return {
        "train": write_split(features[:rows], labels[:rows], out / "train", row_group_size, files),
        "val": write_split(features[rows:], labels[rows:], out / "val", row_group_size, files),
    }
