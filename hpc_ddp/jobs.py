"""Submit training through submitit: `hpc_ddp.submit(config, nodes=2, gpus_per_node=4, ...)`.

Each Slurm task (one per GPU) runs the same training code as `sbatch slurm/train.sh`, with the
same DistEnv resolution. `cluster="local"` uses submitit's local executor: no Slurm needed.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from hpc_ddp.config import Config, load_config
from hpc_ddp.env import LOCAL_RUN_ID_VAR
from hpc_ddp.errors import HpcDdpError
from hpc_ddp.local import threads_per_rank
from hpc_ddp.slurm import derive_master_port

#: The signal submitit's jobs receive on preemption and before the time limit.
SUBMITIT_PREEMPT_SIGNAL: Literal["USR2"] = "USR2"
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?$")


def time_to_minutes(text: str) -> int:
    """Slurm time formats (MM, HH:MM:SS, D-HH:MM:SS, D-HH, ...) to whole minutes, rounded up."""
    match = _TIME.match(text.strip())
    if not match:
        raise HpcDdpError(
            f"time {text!r} is not a Slurm time", "write it as HH:MM:SS, D-HH:MM:SS or minutes"
        )
    days, first, second, third = match.groups()
    day_minutes = int(days or 0) * 24 * 60
    if days and second is None:
        return day_minutes + int(first) * 60  # D-HH
    if second is None:
        return int(first)  # MM
    if third is None:
        if days:
            return day_minutes + int(first) * 60 + int(second)  # D-HH:MM
        return int(first) + (1 if int(second) else 0)  # MM:SS
    seconds = day_minutes * 60 + int(first) * 3600 + int(second) * 60 + int(third)
    return max(1, -(-seconds // 60))


def submitit_local_environ(environ: Mapping[str, str], cpu_count: int) -> dict[str, str]:
    """Describe a task of submitit's local executor as an `hpc-ddp local` rank, sharing the
    machine's ``cpu_count`` CPUs with the other tasks (OMP_NUM_THREADS, unless set).

    Outside the local executor (e.g. under Slurm) ``environ`` comes back unchanged.
    """
    job_id = environ.get("SUBMITIT_LOCAL_JOB_ID")
    if not job_id or environ.get("SLURM_JOB_ID"):
        return dict(environ)
    tasks = environ.get("SUBMITIT_LOCAL_NTASKS", "1")
    digits = re.sub(r"\D", "", job_id) or "0"
    return {
        **environ,
        LOCAL_RUN_ID_VAR: f"submitit-{job_id}",
        "RANK": environ.get("SUBMITIT_LOCAL_GLOBALID", "0"),
        "LOCAL_RANK": environ.get("SUBMITIT_LOCAL_LOCALID", "0"),
        "WORLD_SIZE": tasks,
        "LOCAL_WORLD_SIZE": tasks,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": environ.get("MASTER_PORT") or str(derive_master_port(int(digits))),
        "OMP_NUM_THREADS": environ.get("OMP_NUM_THREADS")
        or str(threads_per_rank(cpu_count, int(tasks))),
    }


class TrainTask:
    """What every submitit task runs: the training entry point on this task's rank.

    Checkpointable in submitit's sense: preemption (USR2, as submitit signals it) stops all
    ranks after the same step with a checkpoint and requeues the job; the requeued job runs
    this same task again, which resumes from that checkpoint (the job id, hence the run
    directory, stays the same).
    """

    def __init__(self, config: Config) -> None:
        self.config = replace(
            config,
            preempt=replace(config.preempt, signal=SUBMITIT_PREEMPT_SIGNAL, stop_on_sigterm=False),
        )

    def checkpoint(self) -> Any:
        """submitit's hook: resubmit the same task; training resumes from its checkpoints."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(TrainTask(self.config))

    def __call__(self) -> dict[str, Any]:
        from hpc_ddp.train import run

        environ = submitit_local_environ(os.environ, os.cpu_count() or 1)
        threads = environ.get("OMP_NUM_THREADS")
        if threads and threads != os.environ.get("OMP_NUM_THREADS"):
            import torch

            # torch sized its thread pool for the whole machine when it started; N local
            # tasks share these cores, as `hpc-ddp local` ranks do.
            torch.set_num_threads(int(threads))
        rank = environ.get("SLURM_PROCID") or environ.get("RANK") or "0"
        try:
            summary = run(self.config, environ, export_to=os.environ)
        except Exception as error:
            raise RuntimeError(f"rank {rank} on {socket.gethostname()} failed: {error}") from error
        if not summary.get("stopped_early"):
            return summary
        if summary.get("requeued"):
            # As submitit itself does after a requeue: exit without a result, so the requeued
            # attempt is the one that delivers it.
            sys.exit(-1)
        raise RuntimeError(
            f"rank {rank} stopped at step {summary['global_step']} after a checkpoint and the job "
            f"was not requeued; submit again with run.id={summary['run_id']} to continue"
        )


def submit(
    config: Config | str | Path,
    *,
    nodes: int = 1,
    gpus_per_node: int = 0,
    tasks_per_node: int | None = None,
    time: str = "01:00:00",
    partition: str | None = None,
    cpus_per_task: int | None = None,
    cluster: str | None = None,
    folder: str | Path = "logs/submitit",
    overrides: Sequence[str] = (),
    name: str = "hpc-ddp",
    slurm_parameters: Mapping[str, Any] | None = None,
) -> Any:
    """Submit a training job and return the submitit Job (``job.results()``: one per rank).

    One task per GPU: ``tasks_per_node`` defaults to ``gpus_per_node`` (1 without GPUs).
    ``cluster``: None detects Slurm, "local" runs on this machine, "slurm" insists on Slurm.
    The config is loaded and checked here, before anything is queued.
    """
    import submitit

    if not isinstance(config, Config):
        config = load_config(config, overrides)
    elif overrides:
        raise HpcDdpError(
            "overrides are applied when loading a config file",
            "pass the YAML path, or change the Config object with dataclasses.replace",
        )
    tasks = tasks_per_node or gpus_per_node or 1
    if tasks_per_node and gpus_per_node and tasks_per_node != gpus_per_node:
        raise HpcDdpError(
            f"tasks_per_node={tasks_per_node} with gpus_per_node={gpus_per_node}",
            "DDP runs one task per GPU: leave tasks_per_node unset",
        )
    executor = submitit.AutoExecutor(folder=str(folder), cluster=cluster)
    parameters: dict[str, Any] = {
        "nodes": nodes,
        "tasks_per_node": tasks,
        "timeout_min": time_to_minutes(time),
        "name": name,
    }
    if gpus_per_node:
        parameters["gpus_per_node"] = gpus_per_node
    if cpus_per_task:
        parameters["cpus_per_task"] = cpus_per_task
    if executor.cluster == "slurm":
        if partition:
            parameters["slurm_partition"] = partition
        parameters.update({f"slurm_{k}": v for k, v in (slurm_parameters or {}).items()})
    elif nodes > 1:
        raise HpcDdpError(
            f"nodes={nodes} needs Slurm, but submitit chose the {executor.cluster!r} executor",
            "use nodes=1 locally, or submit from a machine with Slurm (sbatch on PATH)",
        )
    executor.update_parameters(**parameters)
    return executor.submit(TrainTask(config))


# Errors a rank raises because ANOTHER rank went away: shown after the root cause.
_SECONDARY_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "timed out",
    "Timed out",
    "NCCL communicator was aborted",
)


def _task_failures(job: Any) -> list[tuple[int, str]]:
    """(rank, traceback text) of every failed task, root causes first."""
    from submitit.core.utils import UncompletedJobError

    failures = []
    for rank in range(job.num_tasks):
        try:
            job.task(rank).result()
        except UncompletedJobError as error:
            failures.append((rank, str(error)))
    return sorted(
        failures, key=lambda item: any(marker in item[1] for marker in _SECONDARY_FAILURE_MARKERS)
    )


def wait(job: Any, poll_s: float = 1.0) -> list[dict[str, Any]]:
    """Every rank's result; a failed or cancelled job becomes an HpcDdpError naming it."""
    from submitit.core.utils import FailedJobError, UncompletedJobError

    while not job.done():
        time.sleep(poll_s)
    try:
        return list(job.results())
    except FailedJobError:
        failures = _task_failures(job)
        root_rank, root_trace = failures[0] if failures else (-1, "no traceback recorded")
        others = ", ".join(str(rank) for rank, _ in failures[1:]) or "none"
        raise HpcDdpError(
            f"job {job.job_id} failed on rank {root_rank} (other failed ranks: {others}):\n"
            f"{root_trace}",
            f"the traceback above is rank {root_rank}'s; all logs are in {job.paths.folder}",
        ) from None
    except UncompletedJobError as error:
        raise HpcDdpError(
            f"job {job.job_id} ended {job.state} without results",
            "it was cancelled, timed out or lost its node; see the logs in the submitit folder",
        ) from error
