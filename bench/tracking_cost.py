"""Benchmark 6: what the default tracking (the embedded MLflow store) adds to a whole run.

The run: 2 ranks on this machine, MLP 64-256-256-10 on 20,000 synthetic samples, global batch
256, SGD, 12 epochs, no checkpoints. Tracking off and the default (an existing store in the
output directory) alternate; the figure is each side's median whole-process wall time (from
the ranks' spawn to the last one's exit) and rank 0's seconds in the run's end (``close``:
MLflow's end, the process group down), from summary.json.

A short run shows the end when MLflow's start (about 3 s of CPU) is not over before training
is: 1 rank, 10 steps, so that the tracking process has the second core to itself.

Per-step logging: a loop that logs 3 metrics at every one of 500 steps, 100 steps a second,
through rank 0's hand-over (GuardedTracker and its MLflow process), with the metrics sent one
call per step (gather_s=0) and gathered (the default); the figure is the tracking process's
CPU seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import launch, median, write_result
from hpc_ddp.runtime.tracking.base import RunRecord, default_tracking_uri
from hpc_ddp.runtime.tracking.guard import GATHER_S, GuardedTracker
from hpc_ddp.runtime.tracking.worker import WorkerTracker

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


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def per_step_logging(store: Path, gather_s: float, steps: int = 500, per_s: int = 100) -> float:
    """The tracking process's CPU seconds while a loop logs 3 metrics at every step."""
    started: list[WorkerTracker] = []

    def start() -> WorkerTracker:
        record = RunRecord(name=f"per-step-{gather_s}", params={}, tags={})
        started.append(
            WorkerTracker(default_tracking_uri(store), "per-step", store / "mlartifacts", record)
        )
        return started[0]

    tracker = GuardedTracker(start, "per-step", gather_s=gather_s)
    tracker.log_metrics({"warm": 0.0}, 0)
    tracker._wait("starting")  # MLflow's import and the run's creation are not counted
    before = _cpu_s(started[0]._process.pid)
    for step in range(1, steps + 1):
        tracker.log_metrics({"loss": 1 / step, "lr": 0.1, "grad_norm": 2.0}, step)
        time.sleep(1 / per_s)
    tracker._wait("logging")
    cpu = _cpu_s(started[0]._process.pid) - before
    tracker.finish("FINISHED")
    return cpu


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
    per_call = per_step_logging(root / "tracked", 0.0)
    gathered = per_step_logging(root / "tracked", GATHER_S)
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
        "per_step_logging": {
            "steps": 500,
            "steps_per_s": 100,
            "gather_s": GATHER_S,
            "cpu_s_one_call_per_step": per_call,
            "cpu_s_gathered": gathered,
        },
    }
    print(
        f"tracking: off {median(off):.2f} s, default {median(tracked):.2f} s "
        f"({100 * added:+.1f}%), end {median(end_tracked):.2f} s, a 10-step run's end "
        f"{median(short_end):.2f} s; per-step logging: tracking CPU {per_call:.2f} s one call "
        f"per step, {gathered:.2f} s gathered",
        flush=True,
    )
    write_result("tracking_cost", result)
    return result


if __name__ == "__main__":
    run()
