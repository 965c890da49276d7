"""The launcher environment, resolved once at the edge into a frozen :class:`DistEnv`.

Every function takes an ``environ`` mapping; nothing here writes ``os.environ``.
:func:`export_dist_env` is the one explicit step that does, and it says what it overwrote.

Launchers are detected in this order (pinned by a test):

1. ``torchelastic``: torchrun / TorchElastic set ``TORCHELASTIC_RUN_ID``. It wins over Slurm,
   so ``srun torchrun ...`` (one Slurm task per node, torchrun spawning the local ranks) works.
2. ``local``: ``hpc-ddp local`` sets ``HPC_DDP_LOCAL_RUN_ID``. Also an explicit spawner, so it
   wins over Slurm for the same reason.
3. ``slurm``: a task of a Slurm job step (``srun``), or a one-task batch script. This
   includes submitit's Slurm executor, whose tasks are srun tasks.
4. ``submitit-local``: a task of submitit's local executor (``SUBMITIT_LOCAL_JOB_ID``, no
   Slurm job): submitit started the tasks on this machine, like ``hpc-ddp local``.
5. ``single``: one process, no launcher.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import replace

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.place.distenv import (
    DistEnv,
    dist_env_from,
    port_override,
    read_int,
    read_place,
)
from hpc_ddp.runtime.place.slurm import derive_master_port
from hpc_ddp.runtime.place.slurm_env import resolve_slurm

__all__ = [
    "LAUNCHER_ORDER",
    "DistEnv",
    "available_cpus",
    "detect_launcher",
    "dist_env_variables",
    "export_dist_env",
    "needs_allocation_task_count",
    "resolve_dist_env",
]

LOCAL_RUN_ID_VAR = "HPC_DDP_LOCAL_RUN_ID"
SUBMITIT_LOCAL_JOB_VAR = "SUBMITIT_LOCAL_JOB_ID"
LAUNCHER_ORDER = ("torchelastic", "local", "slurm", "submitit-local", "single")


def with_agreed_elastic_restarts(env: DistEnv, agreed: int, environ: Mapping[str, str]) -> DistEnv:
    """``env`` with torchrun's restart count as the job counts it, ``agreed`` being the largest
    any rank's agent counted: an agent whose own workers did not fail restarts them without
    counting, so on several nodes the counts differ. Outside Slurm it is also the attempt
    count (see _resolve_torchelastic)."""
    if agreed == env.elastic_restarts:
        return env
    restart_count = env.restart_count if "SLURM_JOB_ID" in environ else agreed
    return replace(env, elastic_restarts=agreed, restart_count=restart_count)


def _resolve_torchelastic(environ: Mapping[str, str], hostname: str) -> DistEnv:
    place = read_place(environ, "torchelastic")
    elastic = environ.get("TORCHELASTIC_RESTART_COUNT", "")
    elastic_restarts = int(elastic) if elastic.isdigit() else 0
    requeues = environ.get("SLURM_RESTART_COUNT", "")
    if "SLURM_JOB_ID" in environ:
        restart_count = int(requeues) if requeues.isdigit() else 0
    else:
        restart_count = elastic_restarts
    nodes = max(1, place["world_size"] // max(1, place["local_world_size"]))
    return dist_env_from(
        environ,
        hostname,
        "torchelastic",
        environ.get("SLURM_JOB_ID") or environ.get("TORCHELASTIC_RUN_ID", "torchrun"),
        {**place, "num_nodes": read_int(environ, "GROUP_WORLD_SIZE", nodes)},
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=read_int(environ, "MASTER_PORT"),
        restart_count=restart_count,
        store_hosted_by_launcher=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        elastic_restarts=elastic_restarts,
    )


def _resolve_local(
    environ: Mapping[str, str], hostname: str, configured_port: int | None
) -> DistEnv:
    return dist_env_from(
        environ,
        hostname,
        "local",
        environ[LOCAL_RUN_ID_VAR],
        read_place(environ, "local"),
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=configured_port or read_int(environ, "MASTER_PORT"),
    )


def _resolve_submitit_local(
    environ: Mapping[str, str], hostname: str, configured_port: int | None
) -> DistEnv:
    job_id = environ[SUBMITIT_LOCAL_JOB_VAR]
    place = read_place(environ, "submitit-local")
    port = port_override(environ, configured_port)
    if port is None:
        port = derive_master_port(int(re.sub(r"\D", "", job_id) or 0))
    return dist_env_from(
        environ,
        hostname,
        "submitit-local",
        f"submitit-{job_id}",
        place,
        master_port=port if place["world_size"] > 1 else 0,
    )


def needs_allocation_task_count(environ: Mapping[str, str]) -> bool:
    """True inside an interactive `srun --pty` step, whose variables hide the job's task count."""
    return bool(environ.get("SLURM_PTY_PORT") and environ.get("SLURM_JOB_ID"))


def detect_launcher(environ: Mapping[str, str]) -> str:
    """Name the launcher that started this process, by the priority in the module docstring."""
    if environ.get("TORCHELASTIC_RUN_ID"):
        return "torchelastic"
    if environ.get(LOCAL_RUN_ID_VAR):
        return "local"
    if environ.get("SLURM_JOB_ID"):
        return "slurm"
    if environ.get(SUBMITIT_LOCAL_JOB_VAR):
        return "submitit-local"
    return "single"


def resolve_dist_env(
    environ: Mapping[str, str],
    configured_port: int | None = None,
    hostname: str | None = None,
    single_run_id: str = "single",
    allocation_tasks: int | None = None,
) -> DistEnv:
    """Resolve this process's place in the job from ``environ`` (never written to).

    ``configured_port`` is ``dist.master_port`` from the config; it wins over ``MASTER_PORT``
    and the port derived from the Slurm job id. ``single_run_id`` names a run with no launcher.
    ``allocation_tasks`` is the Slurm job's task count when the caller asked Slurm for it
    (see :func:`needs_allocation_task_count`).
    """
    host = hostname or socket.gethostname()
    launcher = detect_launcher(environ)
    if launcher == "torchelastic":
        resolved = _resolve_torchelastic(environ, host)
    elif launcher == "local":
        resolved = _resolve_local(environ, host, configured_port)
    elif launcher == "slurm":
        resolved = resolve_slurm(environ, host, configured_port, allocation_tasks)
    elif launcher == "submitit-local":
        resolved = _resolve_submitit_local(environ, host, configured_port)
    else:
        refuse_hand_set_world(environ)
        resolved = dist_env_from(environ, host, "single", single_run_id)
    return check_dist_env(resolved)


def refuse_hand_set_world(environ: Mapping[str, str]) -> None:
    """RANK/WORLD_SIZE of several ranks with no launcher's own variables: each process so
    started would train alone, as a world of one, and say nothing."""
    world = environ.get("WORLD_SIZE", "1").strip()
    if world not in ("", "1", "0"):
        raise HpcDdpError(
            f"WORLD_SIZE={world} (RANK={environ.get('RANK', 'unset')}) is set, but no launcher "
            "this toolkit knows started the process: it would train alone, as would every "
            "other one",
            "start the ranks with hpc-ddp local --nproc N, torchrun --nproc-per-node N or "
            "srun (they set the rest), or unset RANK and WORLD_SIZE for one process",
        )


def check_dist_env(env: DistEnv) -> DistEnv:
    """``env`` if its numbers can describe a job; the launcher's variables named if not."""
    problems = []
    if env.world_size < 1 or not 0 <= env.rank < env.world_size:
        problems.append(f"rank {env.rank} of world size {env.world_size}")
    if env.local_world_size < 1 or not 0 <= env.local_rank < env.local_world_size:
        problems.append(f"local rank {env.local_rank} of {env.local_world_size} on the node")
    if env.num_nodes < 1 or not 0 <= env.node_rank < env.num_nodes:
        problems.append(f"node {env.node_rank} of {env.num_nodes}")
    if not 0 <= env.master_port <= 65535:
        problems.append(f"port {env.master_port}")
    if problems:
        raise HpcDdpError(
            f"the {env.launcher} launcher's variables describe no valid job: "
            + "; ".join(problems),
            "check RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and MASTER_PORT (0-65535) "
            "in the environment, or the SLURM_* variables; let the launcher set them",
        )
    return env


def dist_env_variables(dist_env: DistEnv) -> dict[str, str]:
    """The torch.distributed variables for ``dist_env``, as torchrun would set them."""
    return {
        "MASTER_ADDR": dist_env.master_addr,
        "MASTER_PORT": str(dist_env.master_port),
        "RANK": str(dist_env.rank),
        "LOCAL_RANK": str(dist_env.local_rank),
        "WORLD_SIZE": str(dist_env.world_size),
        "LOCAL_WORLD_SIZE": str(dist_env.local_world_size),
        "GROUP_RANK": str(dist_env.node_rank),
    }


def export_dist_env(dist_env: DistEnv, environ: MutableMapping[str, str]) -> dict[str, str]:
    """Write the torch.distributed variables into ``environ``, for user code that reads them.

    Returns ``{name: previous value}`` for every variable it changed, so the caller can log
    each overwrite instead of hiding it.
    """
    overwritten: dict[str, str] = {}
    for name, value in dist_env_variables(dist_env).items():
        previous = environ.get(name)
        if previous is not None and previous != value:
            overwritten[name] = previous
        environ[name] = value
    return overwritten


def available_cpus() -> int:
    """CPUs this process may run on (its affinity: what Slurm or a cgroup gave it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1
