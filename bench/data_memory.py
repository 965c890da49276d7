"""Issue 5's benchmark: per-rank peak memory and bytes read for one training epoch of a
Parquet set, hpc_ddp's row-group sharding vs loading the whole set on every rank.

Each rank runs in its own process (no process group is needed: the shard is a pure function
of rank and world size). Peak memory is the process's high-water RSS (VmHWM; ru_maxrss is not
used because it carries the parent's peak across fork+exec) minus its RSS after imports;
bytes read are the process's rchar from /proc/self/io.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.harness import REPO, base_environ, write_result

ROWS = 3_000_000
FEATURES = 16
ROW_GROUP = 65536
DATA = Path("/tmp/hpc-ddp-bench-parquet")


def _io() -> dict[str, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {"rchar": int(fields["rchar"]), "read_bytes": int(fields["read_bytes"])}


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def measure_rank(mode: str, rank: int, world_size: int) -> dict[str, Any]:
    """One rank's epoch (run inside a fresh process)."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    from hpc_ddp.trainer.parquet import ParquetLoader, ParquetShard

    baseline_mb, io_before = _status_mb("VmRSS"), _io()
    rows = 0
    if mode == "sharded":
        loader = ParquetLoader(
            ParquetShard(str(DATA / "train"), None, "label", rank, world_size, 0, True),
            256,
            0,
            False,
        )
        for features, _labels in loader:
            rows += len(features)
    else:
        table = pq.read_table(DATA / "train")
        names = [n for n in table.column_names if n != "label"]
        features = torch.from_numpy(np.stack([table.column(n).to_numpy() for n in names], axis=1))
        labels = torch.from_numpy(table.column("label").to_numpy())
        del table
        share = range(rank, len(labels), world_size)
        for start in range(0, len(share) - 255, 256):
            batch = torch.as_tensor(share[start : start + 256])
            rows += len(features[batch]) + 0 * int(labels[batch][0])
    io_after = _io()
    peak_mb = _status_mb("VmHWM")
    return {
        "rank": rank,
        "rows": rows,
        "peak_rss_mb": peak_mb,
        "baseline_rss_mb": baseline_mb,
        "data_rss_mb": peak_mb - baseline_mb,
        "bytes_read_mb": (io_after["rchar"] - io_before["rchar"]) / 2**20,
    }


def run() -> dict[str, Any]:
    if not (DATA / "train").exists():
        from hpc_ddp.trainer.datamake import make_dataset

        make_dataset(
            "synthetic", ROWS, ROW_GROUP, DATA, val_rows=1000, files=4, num_features=FEATURES
        )
    results: dict[str, Any] = {"rows": ROWS, "features": FEATURES, "row_group_size": ROW_GROUP}
    for mode in ("sharded", "load_everything"):
        for world_size in (1, 2, 4):
            ranks = []
            for rank in range(world_size):
                output = subprocess.run(
                    [sys.executable, "-m", "bench.data_memory", mode, str(rank), str(world_size)],
                    cwd=REPO,
                    env=base_environ(),
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                ranks.append(json.loads(output))
            worst = max(ranks, key=lambda r: r["data_rss_mb"])
            results[f"{mode}_w{world_size}"] = {
                "max_data_rss_mb": worst["data_rss_mb"],
                "max_bytes_read_mb": max(r["bytes_read_mb"] for r in ranks),
                "rows_per_rank": [r["rows"] for r in ranks],
            }
            print(
                f"{mode:16} W={world_size}: data RSS {worst['data_rss_mb']:7.1f} MB, "
                f"read {results[f'{mode}_w{world_size}']['max_bytes_read_mb']:7.1f} MB per rank",
                flush=True,
            )
    write_result("data_memory", results)
    return results


if __name__ == "__main__":
    if len(sys.argv) == 4:
        print(json.dumps(measure_rank(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
    else:
        run()
