"""When each phase of a rank's life happened, and what the process holds at the end.

The timeline (Unix times) goes into summary.json: rank 0's own marks, and the earliest and
latest rank's for each mark, found with two all-reduces whatever the world size.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_ddp.runtime.place.dist import several_ranks
from hpc_ddp.runtime.place.slurm import queue_job_id

#: The marks, in the order a rank passes them (the trainer's or script's own work between
#: ``started`` and ``training``: data, model, optimizer).
MARKS = (
    "process_start",
    "entry",
    "rendezvous",
    "dist_ready",
    "control_group",
    "checked",
    "started",
    "training",
    "first_step",
)


def process_start_unix(
    stat: str, now_unix: float, now_since_boot: float, ticks_per_s: int
) -> float:
    """The Unix time a process started, from its /proc/<pid>/stat line (field 22: clock ticks
    after boot) and the clocks now (CLOCK_BOOTTIME's seconds since boot, precise where
    /proc/stat's btime is a whole second)."""
    fields_after_name = stat[stat.rindex(")") + 2 :].split()
    started_since_boot = int(fields_after_name[19]) / ticks_per_s
    return now_unix - (now_since_boot - started_since_boot)


def this_process_start_unix() -> float | None:
    """When this process started (None where /proc is not Linux's)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        return process_start_unix(
            stat, time.time(), time.clock_gettime(time.CLOCK_BOOTTIME), os.sysconf("SC_CLK_TCK")
        )
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def slurm_job_start_unix(
    environ: Mapping[str, str], restart_count: int, ask: Callable[[str], float | None]
) -> float | None:
    """When Slurm started the job this attempt runs in, where all of the job so far was this
    run's: a batch job's (``sbatch``) first ``srun`` step (SLURM_STEP_ID 0: ``slurm/train.sh``,
    the torchrun template, submitit) and torchrun's first start of its workers. From
    SLURM_JOB_START_TIME (Slurm 23.02 and later), else ``ask(job)`` (squeue). None outside
    Slurm, in an allocation a person holds (``salloc``, ``srun --pty bash``: its idle time
    is not the run's), in the batch script's own step, in a later step (the job ran
    something else first) and after a restart (the time before it was an earlier attempt's)."""
    job = queue_job_id(environ)
    if job is None or environ.get("ENVIRONMENT") != "BATCH" or "SLURM_PTY_PORT" in environ:
        return None
    if environ.get("SLURM_STEP_ID", "").strip() != "0" or restart_count:
        return None
    given = environ.get("SLURM_JOB_START_TIME", "").strip()
    if given.isdigit() and int(given) > 0:
        return float(given)
    return ask(job)


def new_timeline(entry_unix: float) -> dict[str, float]:
    """The marks known when the toolkit starts: the process start and ``entry``."""
    started = this_process_start_unix()
    timeline = {"entry_unix": entry_unix}
    if started is not None and started <= entry_unix:
        timeline["process_start_unix"] = started
    return timeline


def mark_allocation_start(timeline: dict[str, float], job_start_unix: float | None) -> None:
    """Record where the attempt's allocation began before its process
    (:func:`slurm_job_start_unix`); a start after the process's (another host's clock
    running ahead) is left out."""
    first = timeline.get("process_start_unix", timeline["entry_unix"])
    if job_start_unix is not None and job_start_unix <= first:
        timeline["allocation_start_unix"] = job_start_unix


def mark(timeline: dict[str, float], name: str) -> None:
    """Record ``name`` now, unless it was recorded before."""
    timeline.setdefault(f"{name}_unix", time.time())


def durations(begins: Mapping[str, float], end: float) -> dict[str, float]:
    """Seconds of each phase, from phases begun at ``begins`` (perf_counter, in order) and
    the last one ended at ``end``."""
    names, starts = list(begins), list(begins.values())
    return {
        name: round(stop - start, 4)
        for name, start, stop in zip(names, starts, [*starts[1:], end], strict=True)
    }


def rank_spread(timeline: Mapping[str, float], group: Any | None) -> dict[str, dict[str, float]]:
    """The earliest and latest rank's time for every mark (a collective: every rank calls
    it). A mark some rank lacks is left out."""
    keys = [f"{name}_unix" for name in MARKS]
    values = torch.tensor(
        [timeline.get(key, float("nan")) for key in keys], dtype=torch.float64
    ).nan_to_num(nan=float("inf"))
    # MAX over [x, -x] gives the latest and the earliest in one all-reduce; a missing mark is
    # +inf, so its latest is +inf and it drops out below.
    both = torch.cat([values, -values])
    if several_ranks():
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    latest, earliest = both[: len(keys)].tolist(), (-both[len(keys) :]).tolist()
    present = [i for i, value in enumerate(latest) if value != float("inf")]
    return {
        "earliest": {keys[i]: earliest[i] for i in present},
        "latest": {keys[i]: latest[i] for i in present},
    }


def process_resources() -> dict[str, float | int]:
    """This process's peak resident memory (MiB) and the sockets it has open now."""
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sockets = 0
    try:
        for entry in os.scandir("/proc/self/fd"):
            try:
                sockets += os.readlink(entry.path).startswith("socket:")
            except OSError:
                continue
    except OSError:
        sockets = -1
    return {"peak_rss_mib": round(peak_kib / 1024, 1), "open_sockets": sockets}
