"""Benchmark 9: from a stop to the next attempt's first step on the test Slurm cluster, for a
node that fails the checks (left out of the job, which is requeued held, its ExcNodeList
updated and released) against a plain requeue (`preempt.stop_at_step`: checkpoint, then
`scontrol requeue`). Two nodes, one task each, the built-in trainer on a tiny problem.

- node failure: from the failure recorded in excluded_hosts.json (``at_unix``) to the next
  attempt's first finished step (summary.json);
- plain requeue: from the stop's checkpoint on disk (its folder's time) to the resumed
  attempt's first finished step.

    python -m bench.requeue_cost [repeats]      # after `make cluster-up` (3 nodes)
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.harness import REPO, write_result
from bench.scale import cluster_answers, job_state, slurm, wait_until

PROBLEM = [
    "data.num_samples=3072",
    "data.batch_size=96",
    "train.epochs=1",
    "tracking.enabled=false",
]
#: Fails on the first attempt's last node whenever it is in the job (as tests/test_slurm_e2e).
HEALTH = """#!/bin/sh
if [ ! -f {bad} ]; then
  scontrol show hostnames "$SLURM_JOB_NODELIST" | tail -n 1 > {bad}.$$ && mv {bad}.$$ {bad}
fi
if [ "$SLURMD_NODENAME" = "$(cat {bad})" ]; then echo "bad node"; exit 1; fi
"""


def finished(job: str, work: Path) -> dict[str, Any]:
    wait_until(lambda: job_state(job, work) in ("COMPLETED", "FAILED", "CANCELLED"),
               f"job {job} to end", 600, poll=0.5)  # fmt: skip
    state = job_state(job, work)
    if state != "COMPLETED":
        raise RuntimeError(f"job {job} ended {state}; see {work}")
    summary = next((work / "runs").glob(f"*/{job}/summary.json"))
    return dict(json.loads(summary.read_text()))


def sbatch(work: Path, args: list[str]) -> str:
    out = slurm(["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", "--time=10",
                 str(REPO / "slurm" / "train.sh"), "configs/synthetic.yaml",
                 f"run.output_dir={work / 'runs'}", *PROBLEM, *args], work)  # fmt: skip
    return out.strip().split(";")[0]


def node_failure(work: Path) -> float:
    health, bad = work / "health.sh", work / "bad-node"
    health.write_text(HEALTH.format(bad=bad))
    job = sbatch(work, [f"checks.command=sh {health}"])
    summary = finished(job, work)
    failure = json.loads(next((work / "runs").glob(f"*/{job}/excluded_hosts.json")).read_text())
    return float(summary["first_step_unix"]) - float(failure[0]["at_unix"])


def plain_requeue(work: Path) -> float:
    job = sbatch(work, ["preempt.stop_at_step=5"])
    summary = finished(job, work)
    stop = next((work / "runs").glob(f"*/{job}/checkpoints/step-000000005"))
    return float(summary["first_step_unix"]) - (stop / ".metadata").stat().st_mtime


def run(repeats: int = 3) -> dict[str, Any] | None:
    if not cluster_answers():
        return None
    rows: dict[str, list[float]] = {"node_failure": [], "plain_requeue": []}
    for _ in range(repeats):
        for name, measure in (("node_failure", node_failure), ("plain_requeue", plain_requeue)):
            with tempfile.TemporaryDirectory(dir=REPO / ".cluster") as folder:
                work = Path(folder)
                (work / "configs").symlink_to(REPO / "configs")
                rows[name].append(round(measure(work), 2))
    medians = {name: statistics.median(values) for name, values in rows.items()}
    result = {"repeats": repeats, "seconds": rows, "median_s": medians}
    write_result("requeue_cost", result)
    return result


if __name__ == "__main__":
    print(json.dumps(run(*(int(arg) for arg in sys.argv[1:])), indent=1))
