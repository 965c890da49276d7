"""Parquet row-group sharding: every row once per epoch across ranks and workers, equal steps,
reshuffled epochs, mid-epoch resume, reading only a rank's share, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.trainer.parquet import ParquetLoader, ParquetShard
from tests.helpers import clean_environ, run_local

GROUP_SIZES = [[50, 50, 37], [64], [10, 10, 10, 10, 3]]  # three files, uneven row groups


@pytest.fixture(scope="module")
def id_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Row i has feature f0 = i, so every row can be traced; 244 rows in 9 row groups."""
    root = tmp_path_factory.mktemp("ids")
    row = 0
    for index, sizes in enumerate(GROUP_SIZES):
        writer = None
        for size in sizes:
            ids = np.arange(row, row + size)
            table = pa.table(
                {"f0": ids.astype(np.float32), "f1": np.ones(size, np.float32), "label": ids % 3}
            )
            writer = writer or pq.ParquetWriter(root / f"part-{index}.parquet", table.schema)
            writer.write_table(table)
            row += size
        assert writer is not None
        writer.close()
    return root


TOTAL = sum(map(sum, GROUP_SIZES))


def ids_of(loader: ParquetLoader) -> list[int]:
    return [int(v) for features, _ in loader for v in features[:, 0].tolist()]


def loaders(
    root: Path, world_size: int, workers: int, training: bool, batch: int = 1
) -> list[ParquetLoader]:
    return [
        ParquetLoader(
            ParquetShard(str(root), None, "label", rank, world_size, 5, training),
            batch,
            workers,
            False,
        )
        for rank in range(world_size)
    ]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.e2e)])  # 2: processes
def test_every_row_once_per_epoch_across_ranks_and_workers(
    id_dataset: Path, world_size: int, workers: int
) -> None:
    ranks = loaders(id_dataset, world_size, workers, training=True)
    for epoch in (0, 1):
        seen = []
        for loader in ranks:
            loader.set_epoch(epoch)
            seen += ids_of(loader)
        assert len(seen) == len(set(seen)), "no row twice"
        assert len(seen) == (TOTAL // world_size) * world_size, (
            "only the tail of fewer than W rows sits out"
        )
        assert {len(loader) for loader in ranks} == {TOTAL // world_size}, (
            "equal steps on every rank"
        )
    evaluation = [
        i
        for loader in loaders(id_dataset, world_size, workers, training=False, batch=16)
        for i in ids_of(loader)
    ]
    assert sorted(evaluation) == list(range(TOTAL)), "validation: every row exactly once"


@pytest.mark.e2e
def test_workers_do_not_change_the_order_and_epochs_reshuffle(id_dataset: Path) -> None:
    without, with_workers = (
        loaders(id_dataset, 2, 0, True, batch=8)[1],
        loaders(id_dataset, 2, 2, True, batch=8)[1],
    )
    assert ids_of(without) == ids_of(with_workers)
    first = ids_of(without)
    without.set_epoch(1)
    second = ids_of(without)
    assert first != second
    assert len(first) == len(second) == (TOTAL // 2 // 8) * 8


def test_mid_epoch_start_skips_rows_without_reading_them(id_dataset: Path) -> None:
    loader = loaders(id_dataset, 2, 0, True, batch=8)[0]
    full = list(loader)
    loader.set_start(5 * 8)
    resumed = list(loader)
    assert len(resumed) == len(full) - 5
    for (a, _), (b, _) in zip(resumed, full[5:], strict=True):
        assert torch.equal(a, b)


def test_a_rank_reads_only_its_share(tmp_path: Path) -> None:
    table = pa.table({"f0": np.arange(8000, dtype=np.float32), "label": np.zeros(8000, np.int64)})
    pq.write_table(table, tmp_path / "big.parquet", row_group_size=500)
    whole = ParquetShard(str(tmp_path), None, "label", 0, 1, 0, True)
    list(whole)
    for world_size in (2, 4):
        shard = ParquetShard(str(tmp_path), None, "label", 1, world_size, 0, True)
        list(shard)
        group_bytes = whole.bytes_read / 16
        assert shard.bytes_read <= whole.bytes_read / world_size + 2 * group_bytes


def test_bad_path_and_columns_are_named(tmp_path: Path, id_dataset: Path) -> None:
    with pytest.raises(HpcDdpError, match="no Parquet files at"):
        ParquetShard(str(tmp_path / "nothing-*.parquet"), None, "label", 0, 1, 0, True)
    with pytest.raises(HpcDdpError) as caught:
        ParquetShard(str(id_dataset), ["f0", "pixels"], "label", 0, 1, 0, True)
    assert "part-0.parquet has no column(s) ['pixels']" in str(caught.value)
    assert "valid columns: f0, f1, label" in str(caught.value)
    with pytest.raises(HpcDdpError, match="no label column 'target'"):
        ParquetShard(str(id_dataset), None, "target", 0, 1, 0, True)
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(HpcDdpError, match="cannot read Parquet file"):
        ParquetShard(str(tmp_path / "junk.parquet"), None, "label", 0, 1, 0, True)


@pytest.fixture(scope="module")
def made_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("made")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpc_ddp",
            "data",
            "make",
            "--kind",
            "synthetic",
            "--rows",
            "12800",
            "--val-rows",
            "1001",
            "--row-group-size",
            "700",
            "--files",
            "3",
            "--out",
            str(out),
        ],
        env=clean_environ(),
        capture_output=True,
        text=True,
        check=True,
    )
    assert "data.kind=parquet" in result.stdout
    return out


@pytest.mark.e2e
def test_data_make_writes_row_groups(made_set: Path) -> None:
    files = sorted((made_set / "train").glob("*.parquet"))
    assert len(files) == 3
    metadata = [pq.ParquetFile(f).metadata for f in files]
    assert sum(m.num_rows for m in metadata) == 12800
    assert all(m.row_group(0).num_rows == 700 for m in metadata)
    assert pq.ParquetFile(files[0]).schema_arrow.names[-1] == "label"


def test_digits_set_is_made_from_the_bundled_data(tmp_path: Path) -> None:
    from hpc_ddp.trainer.datamake import make_dataset

    written = make_dataset("digits", 3000, 512, tmp_path, val_rows=100)
    table = pq.read_table(written["train"][0])
    assert table.num_rows == 3000 and table.num_columns == 65
    assert set(table.column("label").to_pylist()) == set(range(10))


@pytest.mark.e2e
def test_parquet_training_two_ranks_exact_validation(made_set: Path, tmp_path: Path) -> None:
    result = run_local(
        2,
        tmp_path,
        [
            "data.kind=parquet",
            f"data.train_path={made_set / 'train'}",
            f"data.val_path={made_set / 'val'}",
            "data.batch_size=64",
            "train.epochs=2",
            "tracking.enabled=false",
            "data.num_workers=1",
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(next(tmp_path.glob("*/*/summary.json")).read_text())
    assert summary["val_samples"] == 1001 and summary["global_step"] == 2 * 200
    assert summary["val_accuracy"] > 0.5


@pytest.mark.e2e
def test_parquet_mid_epoch_resume_is_exact(made_set: Path, tmp_path: Path) -> None:
    common = [
        "data.kind=parquet",
        f"data.train_path={made_set / 'train'}",
        f"data.val_path={made_set / 'val'}",
        "data.batch_size=64",
        "train.epochs=3",
        "train.log_interval=4",
        "tracking.enabled=false",
        "preempt.check_every_steps=1",
    ]
    reference = run_local(2, tmp_path, [*common, "run.id=reference"])
    assert reference.returncode == 0, reference.stderr[-2000:]
    stopping = run_local(2, tmp_path, [*common, "run.id=resumed", "preempt.stop_at_step=30"])
    assert stopping.returncode == 3, stopping.stderr[-2000:]
    assert "checkpoint (stop signal) step 30:" in stopping.stderr, "mid-epoch"
    resumed = run_local(2, tmp_path, [*common, "run.id=resumed"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summaries = {
        p.parent.name: json.loads(p.read_text()) for p in tmp_path.glob("*/*/summary.json")
    }
    assert summaries["resumed"]["weights_sha256"] == summaries["reference"]["weights_sha256"]
    assert summaries["resumed"]["resumed_from_step"] == 30


BAD_SETS = {
    "no rows": (pa.table({"f0": pa.array([], pa.float32()), "y": pa.array([], pa.int64())}),
                "has no rows"),
    "text feature": (pa.table({"f0": ["a", "b"] * 20, "y": [0, 1] * 20}),
                     "feature column 'f0' holds string, not numbers"),
    "label too big": (pa.table({"f0": [0.5] * 40, "y": [0, 7] * 20}),
                      "label 7 in column 'y' is outside 0..1 (data.num_classes=2)"),
    "negative label": (pa.table({"f0": [0.5] * 40, "y": [0, -1] * 20}),
                       "label -1 in column 'y' is outside 0..1"),
    "text label": (pa.table({"f0": [0.5] * 40, "y": ["a", "b"] * 20}),
                   "label column 'y' holds string, expected integer class ids 0..1"),
    "label only": (pa.table({"y": [0, 1] * 20}), "has no feature column"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_SETS))
def test_parquet_that_training_would_fail_on_is_refused_up_front(case: str, tmp_path: Path) -> None:
    table, message = BAD_SETS[case]
    for split in ("train", "val"):
        (tmp_path / split).mkdir()
        pq.write_table(table, tmp_path / split / "part.parquet")
    from hpc_ddp.trainer.config import load_config
    from hpc_ddp.trainer.datasets import build_datasets

    config = load_config(
        None,
        ["data.kind=parquet", f"data.train_path={tmp_path / 'train'}",
         f"data.val_path={tmp_path / 'val'}", "data.label_column=y", "data.num_classes=2"],
    )  # fmt: skip
    with pytest.raises(HpcDdpError) as refused:
        build_datasets(config)
    assert message in str(refused.value) and "HINT:" in str(refused.value)
