"""Benchmark 5: how start-up, the stop, checkpoints and the run's end grow with the world size.

Every figure comes from the real Slurm path: `sbatch slurm/train.sh` on the test cluster
(`make cluster-up NODES=16` gives 16 nodes of 2 CPUs: up to 32 ranks, on however many cores
the machine has), one task per "GPU" (the cluster's stand-in GRES), the built-in trainer on a
tiny synthetic problem so that 32 ranks fit in memory. Per world size W:

- a short run (tracking off: bench/tracking_cost.py measures it): its summary.json gives
  rank 0's timeline from process start to the first
  finished step, the earliest and latest rank's, the last checkpoint's save by phase, the end
  of the run by phase, rank 0's peak memory and open sockets; a site file records when the
  batch script started;
- a long run stopped by `scancel --signal=USR1`: seconds until the checkpoint is on disk and
  until the job has left the RUNNING state (every rank stopped).

    python -m bench.scale [W ...]        # default 1 2 4 8 16 32, as many as the cluster holds
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import REPO, RESULTS, write_result

WORLD_SIZES = (1, 2, 4, 8, 16, 32)
TASKS_PER_NODE = 2
PROBLEM = [
    "model.hidden_sizes=[16]",
    "data.num_val_samples=256",
    "optim.warmup_steps=0",
    "dist.init_timeout_s=900",
    # MLflow's start (about 2.5 s of CPU in a child of rank 0, at a lower priority) would
    # queue behind W ranks on this machine's cores and blur the toolkit's own figures; its
    # cost is measured apart (bench/tracking_cost.py).
    "tracking.enabled=false",
]
SITE = 'echo "$(date +%s.%N)" > "logs/job-start-${SLURM_JOB_ID}"\n'


def slurm_env() -> dict[str, str]:
    conf = os.environ.get("SLURM_CONF") or str(REPO / ".cluster" / "slurm.conf")
    venv_bin = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "SLURM_CONF": conf,
        "PATH": f"{venv_bin}:{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "PYTHON": sys.executable,
    }


def slurm(command: list[str], cwd: Path) -> str:
    result = subprocess.run(
        command, cwd=cwd, env=slurm_env(), capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()}")
    return result.stdout


def cluster_answers() -> bool:
    """Whether a test Slurm cluster is up (else `make bench` leaves the scale figures be)."""
    try:
        slurm(["sinfo", "-h"], REPO)
    except (RuntimeError, OSError):
        print("scale: no Slurm cluster answers; `make cluster-up NODES=16` first", flush=True)
        return False
    return True


def node_count(cwd: Path) -> int:
    return len(slurm(["sinfo", "-h", "-N", "-o", "%N"], cwd).split())


def job_state(job_id: str, cwd: Path) -> str:
    out = slurm(["scontrol", "show", "job", "-o", job_id], cwd)
    match = re.search(r"\bJobState=(\S+)", out)
    return match.group(1) if match else "UNKNOWN"


def submit(world_size: int, args: list[str], workdir: Path) -> str:
    nodes, per_node = max(1, world_size // TASKS_PER_NODE), min(world_size, TASKS_PER_NODE)
    out = slurm(
        [
            "sbatch",
            "--parsable",
            f"--nodes={nodes}",
            f"--ntasks-per-node={per_node}",
            f"--gpus-per-node={per_node}",
            "--time=00:30:00",
            str(REPO / "slurm" / "train.sh"),
            "configs/synthetic.yaml",
            *PROBLEM,
            f"data.batch_size={32 * world_size}",  # 32 samples per rank and step
            *args,
        ],
        workdir,
    )
    return out.strip().split(";")[0]


def wait_until(condition: Any, what: str, timeout: float, poll: float = 0.1) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return time.time()
        time.sleep(poll)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def run_dir(workdir: Path, job_id: str) -> Path:
    return workdir / "runs" / "synthetic-mlp" / job_id


def short_run(world_size: int, workdir: Path) -> dict[str, Any]:
    """A run of a few steps per rank: start-up, the save, the end, memory and sockets."""
    samples = 32 * world_size * 8  # 8 steps of 32 per rank, one epoch
    job = submit(world_size, [f"data.num_samples={samples}", "train.epochs=1"], workdir)
    wait_until(
        lambda: job_state(job, workdir) not in ("PENDING", "RUNNING", "CONFIGURING"),
        f"job {job}",
        900,
        poll=0.5,
    )
    state = job_state(job, workdir)
    log = workdir / f"hpc-ddp-{job}.out"  # the templates log in the submission directory
    if state != "COMPLETED":
        raise RuntimeError(f"job {job} (W={world_size}) ended {state}:\n{log.read_text()[-3000:]}")
    summary = json.loads((run_dir(workdir, job) / "summary.json").read_text())
    job_start = float((workdir / "logs" / f"job-start-{job}").read_text())
    timeline = summary["timeline"]
    latest = summary["timeline_ranks"]["latest"]
    earliest = summary["timeline_ranks"]["earliest"]

    def since_job(marks: dict[str, float]) -> dict[str, float]:
        return {k.removesuffix("_unix"): round(v - job_start, 3) for k, v in marks.items()}

    return {
        "job_id": job,
        "rank0": since_job(timeline),
        "latest_rank": since_job(latest),
        "earliest_rank": since_job(earliest),
        "checkpoint_save_s": summary["last_checkpoint_save_s"],
        "ending_s": summary["ending_s"],
        "peak_rss_mib": summary["peak_rss_mib"],
        "open_sockets": summary["open_sockets"],
        "tracking": summary["tracking"],
    }


def stop_latency(world_size: int, workdir: Path) -> dict[str, float]:
    """Seconds from `scancel --signal=USR1` to the checkpoint on disk and to the job ended."""
    job = submit(
        world_size,
        # Each rank makes the whole synthetic set: keep it small (32 ranks share 24 GiB here).
        ["data.num_samples=100000", "train.epochs=1000", "preempt.requeue=false"],
        workdir,
    )
    log = workdir / f"hpc-ddp-{job}.out"  # the templates log in the submission directory
    # Stop well inside training: after the first progress line (all ranks are stepping).
    wait_until(
        lambda: log.exists() and "stop signals are checked" in log.read_text(),
        f"job {job} training",
        900,
        poll=0.3,
    )
    time.sleep(3.0)
    signalled = time.time()
    slurm(["scancel", "--signal=USR1", job], workdir)
    checkpoints = run_dir(workdir, job) / "checkpoints"
    written = wait_until(lambda: any(checkpoints.glob("step-*.pt")), "the checkpoint", 600)
    ended = wait_until(
        lambda: job_state(job, workdir) not in ("RUNNING", "CONFIGURING"), "the job's end", 600
    )
    newest = max(checkpoints.glob("step-*.pt"), key=lambda path: path.stat().st_mtime)
    return {
        "checkpoint_on_disk_s": round(min(written, newest.stat().st_mtime) - signalled, 3),
        "all_ranks_stopped_s": round(ended - signalled, 3),
    }


def run(world_sizes: tuple[int, ...] = WORLD_SIZES) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="hpc-ddp-scale-"))
    shutil.copytree(REPO / "configs", workdir / "configs")
    (workdir / "logs").mkdir()
    (workdir / "site.sh").write_text(SITE)
    os.environ["HPC_DDP_SITE"] = str(workdir / "site.sh")
    nodes = node_count(workdir)
    fits = [w for w in world_sizes if max(1, w // TASKS_PER_NODE) <= nodes]
    skipped = sorted(set(world_sizes) - set(fits))
    if skipped:
        print(f"scale: {nodes} nodes; skipping W={skipped} (make cluster-up NODES=16)")
    earlier = RESULTS / "scale.json"
    measured = json.loads(earlier.read_text())["by_world_size"] if earlier.exists() else {}
    results: dict[str, Any] = {"nodes": nodes, "cores": os.cpu_count(), "by_world_size": measured}
    for world_size in fits:
        row = short_run(world_size, workdir)
        row["stop"] = stop_latency(world_size, workdir)
        results["by_world_size"][str(world_size)] = row
        write_result("scale", results)  # after each world size: a later failure keeps it
        print(
            f"W={world_size}: first step {row['rank0']['first_step']:.1f} s after job start, "
            f"stop {row['stop']['all_ranks_stopped_s']:.1f} s, "
            f"end {sum(row['ending_s'].values()):.2f} s, "
            f"rank 0 {row['peak_rss_mib']:.0f} MiB {row['open_sockets']} sockets",
            flush=True,
        )
    if fits:
        results["eager_gloo"] = eager_gloo(max(fits), workdir)
        write_result("scale", results)
    shutil.rmtree(workdir, ignore_errors=True)
    return results


def eager_gloo(world_size: int, workdir: Path) -> dict[str, Any]:
    """The short run again with torch's default gloo set-up (every pair connected when a
    group is made): its process-group phase and rank 0's sockets."""
    os.environ["TORCH_GLOO_LAZY_INIT"] = "0"  # sbatch passes it on (--export=ALL)
    try:
        row = short_run(world_size, workdir)
    finally:
        del os.environ["TORCH_GLOO_LAZY_INIT"]
    latest = row["latest_rank"]
    print(f"W={world_size} with eager gloo: {row['open_sockets']} sockets on rank 0", flush=True)
    return {
        "world_size": world_size,
        "process_groups_s": round(latest["control_group"] - latest["rendezvous"], 3),
        "open_sockets": row["open_sockets"],
        "first_step": row["rank0"]["first_step"],
    }


if __name__ == "__main__":
    run(tuple(int(w) for w in sys.argv[1:]) or WORLD_SIZES)
