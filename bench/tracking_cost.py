"""Benchmark 6: what the default tracking (the embedded MLflow store) adds to a whole run.

The run: 2 ranks on this machine, MLP 64-256-256-10 on 20,000 synthetic samples, global batch
256, SGD, 12 epochs, no checkpoints. Tracking off and the default (an existing store in the
output directory) alternate; the figure is each side's median whole-process wall time (from
the ranks' spawn to the last one's exit) and rank 0's seconds in the run's end (``close``:
MLflow's end, the process group down), from summary.json.

A short run shows the end when MLflow's start (about 3 s of CPU) is not over before training
is: 1 rank, 10 steps, so that the tracking process has the second core to itself.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import launch, median, write_result

RUN = [
    "--config",
    "configs/synthetic.yaml",
    "model.hidden_sizes=[256,256]",
    "data.num_samples=20000",
    "data.batch_size=256",
    "train.epochs=12",
    "optim.name=sgd",
    "optim.lr=0.05",
    "checkpoint.enabled=false",
]


SHORT = ["--config", "configs/synthetic.yaml", "train.max_steps=10"]


def _one(
    output_dir: Path, tracking: bool, run: list[str] = RUN, ranks: int = 2
) -> tuple[float, float]:
    args = [*run, f"run.output_dir={output_dir}"]
    if not tracking:
        args.append("tracking.enabled=false")
    started = time.time()
    out, _ = launch(ranks, "hpc_ddp.train", args)
    wall = time.time() - started
    summary = json.loads(Path(out["summary_path"]).read_text())
    return wall, summary["ending_s"]["close"]


def run(repeats: int = 9) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="hpc-ddp-tracking-"))
    _one(root / "tracked", True)  # the store exists from here on, as after a user's first run
    off: list[float] = []
    tracked: list[float] = []
    end_off: list[float] = []
    end_tracked: list[float] = []
    for _ in range(repeats):
        wall, end = _one(root / "off", False)
        off.append(wall)
        end_off.append(end)
        wall, end = _one(root / "tracked", True)
        tracked.append(wall)
        end_tracked.append(end)
    short_end: list[float] = []
    for _ in range(5):
        short_end.append(_one(root / "tracked", True, SHORT, 1)[1])
    shutil.rmtree(root, ignore_errors=True)
    added = median(tracked) / median(off) - 1
    result: dict[str, Any] = {
        "repeats": repeats,
        "off_wall_s": off,
        "tracked_wall_s": tracked,
        "off_end_s": end_off,
        "tracked_end_s": end_tracked,
        "off_median_s": median(off),
        "tracked_median_s": median(tracked),
        "added_fraction": added,
        "tracked_end_median_s": median(end_tracked),
        "off_end_median_s": median(end_off),
        "short_run_end_s": short_end,
        "short_run_end_median_s": median(short_end),
    }
    print(
        f"tracking: off {median(off):.2f} s, default {median(tracked):.2f} s "
        f"({100 * added:+.1f}%), end {median(end_tracked):.2f} s, a 10-step run's end "
        f"{median(short_end):.2f} s",
        flush=True,
    )
    write_result("tracking_cost", result)
    return result


if __name__ == "__main__":
    run()
