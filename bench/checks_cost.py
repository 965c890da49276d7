"""What the checks before the first step cost at start (issue: a healthy job pays under 5 s).

1. W = 1, 2 and 4 local CPU ranks of the built-in trainer (one step, checks.command=true):
   the start's time from the process groups to the checks' end (rank 0's timeline), and each
   check's seconds on the slowest rank (checks.json).
2. On a GPU (``python -m bench.checks_cost gpu``, recorded beside part 1): each device
   check on cuda:0, the first call (CUDA's kernels loaded) and the next.

    python -m bench.checks_cost && python -m bench.report   # bench/results/checks_cost.json
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import RESULTS, hpc_ddp_args, launch, machine, write_result

WORLDS = (1, 2, 4)
MODEL: dict[str, Any] = {"hidden": [256, 256], "samples": 4096, "epochs": 1}


def one_start(world: int) -> dict[str, Any]:
    """One run's checks: their share of the start, and each check's slowest rank."""
    with tempfile.TemporaryDirectory() as output_dir:
        arguments = [*hpc_ddp_args(**MODEL), "train.max_steps=1", "checks.command=true",
                     f"run.output_dir={output_dir}"]  # fmt: skip
        summary, _ = launch(world, "hpc_ddp.train", arguments)
        record = json.loads(next(Path(output_dir).glob("*/*/checks.json")).read_text())
    timeline = summary["timeline"]
    slowest: dict[str, float] = {}
    for rank in record["ranks"]:
        for check, seconds in rank["seconds"].items():
            slowest[check] = max(slowest.get(check, 0.0), seconds)
    return {"start_s": timeline["checked_unix"] - timeline["control_group_unix"], **slowest}


def cpu_ranks(repeats: int) -> list[dict[str, Any]]:
    rows = []
    for world in WORLDS:
        runs = [one_start(world) for _ in range(repeats)]
        row = {key: round(statistics.median(run[key] for run in runs), 3) for key in runs[0]}
        rows.append({"world_size": world, "repeats": repeats, **row})
        print(f"W={world}: checks {row['start_s']:.2f} s of the start ({row})", flush=True)
    return rows


def gpu_devices() -> dict[str, Any] | None:
    """Each device check on cuda:0, twice (None without a GPU)."""
    import torch

    from bench.gpu import gpu_facts
    from hpc_ddp.runtime.place.health import device_findings

    facts = gpu_facts()
    if facts is None:
        return None
    seconds, findings = [], []
    for _ in range(2):
        began = time.perf_counter()
        findings = device_findings(["cuda:0"], 0.5)
        torch.cuda.synchronize()
        seconds.append(round(time.perf_counter() - began, 3))
    return {**facts, "first_s": seconds[0], "next_s": seconds[1],
            "findings": [finding.line() for finding in findings]}  # fmt: skip


def run(repeats: int = 3) -> dict[str, Any]:
    result = {"cpu": cpu_ranks(repeats), "gpu": None}
    path = RESULTS / "checks_cost.json"
    if path.exists():  # the GPU's figures stay until a GPU takes them again
        result["gpu"] = json.loads(path.read_text()).get("gpu")
    write_result("checks_cost", result)
    return result


def run_gpu_part() -> int:
    measured = gpu_devices()
    if measured is None:
        print("bench.checks_cost gpu: no CUDA GPU is visible", file=sys.stderr)
        return 2
    path = RESULTS / "checks_cost.json"
    recorded = json.loads(path.read_text()) if path.exists() else {"cpu": []}
    cpu_machine = recorded.pop("machine", None)
    # The GPU's machine goes with its figures; the file's own stays the CPU figures'.
    path.write_text(
        json.dumps({**recorded, "gpu": {**measured, "machine": machine()},
                    "machine": cpu_machine or machine()}, indent=2, sort_keys=True) + "\n"
    )  # fmt: skip
    print(f"gpu {measured}", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["gpu"]:
        sys.exit(run_gpu_part())
    run()
