"""A Slurm task's place in its job step, and the launches that would hang, refused first.

Slurm's step variables (``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_TASKS_PER_NODE``,
``SLURM_STEP_NODELIST``) win over the job's: they describe this ``srun``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.place.distenv import DistEnv, dist_env_from, port_override, read_int
from hpc_ddp.runtime.place.slurm import derive_master_port, expand_hostlist, expand_tasks_per_node


def _job_task_count(environ: Mapping[str, str]) -> int:
    """Tasks of the whole allocation (not of a step): SLURM_NTASKS, else the tasks-per-node sum."""
    if environ.get("SLURM_NTASKS"):
        return read_int(environ, "SLURM_NTASKS")
    if environ.get("SLURM_TASKS_PER_NODE"):
        return sum(expand_tasks_per_node(environ["SLURM_TASKS_PER_NODE"]))
    return 1


def _reject_unlaunched_allocation(environ: Mapping[str, str], job_tasks: int) -> None:
    """Python started directly in a batch script or salloc shell of N>1 tasks would wait forever."""
    if job_tasks <= 1:
        return
    where = "a batch script" if environ.get("SLURMD_NODENAME") else "an salloc shell"
    raise HpcDdpError(
        f"this process runs inside Slurm job {environ.get('SLURM_JOB_ID')} of {job_tasks} tasks "
        f"({where}), but it was not started by srun: it would be the only rank and wait "
        f"forever for the other {job_tasks - 1}",
        "start training with `srun python train.py ...` (or `srun python -m hpc_ddp.train "
        "...`; slurm/train.sh does this), so that Slurm starts one process per task",
    )


def _reject_interactive_pty_step(
    environ: Mapping[str, str], step_tasks: int, allocation_tasks: int | None
) -> None:
    """An `srun --pty bash` shell is a one-task step; training started in it runs on one rank.

    Inside that step Slurm reports SLURM_NTASKS=1, so the allocation's real task count comes
    from ``allocation_tasks`` (asked of scontrol at the edge) when known.
    """
    job_tasks = allocation_tasks or _job_task_count(environ)
    if environ.get("SLURM_PTY_PORT") and step_tasks == 1 and job_tasks > 1:
        raise HpcDdpError(
            f"this is an interactive `srun --pty` shell (a job step of 1 task) inside Slurm job "
            f"{environ.get('SLURM_JOB_ID')} of {job_tasks} tasks: training would run on 1 rank, "
            f"not {job_tasks}",
            f"from this shell run `srun --overlap --ntasks={job_tasks} python -m hpc_ddp.train "
            "...`, or use `salloc` and then `srun python -m hpc_ddp.train ...`",
        )


def resolve_slurm(
    environ: Mapping[str, str],
    hostname: str,
    configured_port: int | None,
    allocation_tasks: int | None,
) -> DistEnv:
    """This task's DistEnv in its step (or, in a one-task batch script, ``single``'s)."""
    job_id = environ["SLURM_JOB_ID"]
    restart_count = read_int(environ, "SLURM_RESTART_COUNT", 0)
    if not environ.get("SLURM_STEP_ID"):
        _reject_unlaunched_allocation(environ, _job_task_count(environ))
        return dist_env_from(environ, hostname, "slurm", job_id, restart_count=restart_count)

    world_size = read_int(environ, "SLURM_STEP_NUM_TASKS", _job_task_count(environ))
    _reject_interactive_pty_step(environ, world_size, allocation_tasks)
    nodelist = (
        environ.get("SLURM_STEP_NODELIST")
        or environ.get("SLURM_JOB_NODELIST")
        or environ.get("SLURM_NODELIST")
        or hostname
    )
    hosts = expand_hostlist(nodelist)
    tasks_spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    tasks_per_node = expand_tasks_per_node(tasks_spec) if tasks_spec else [world_size]
    if len(tasks_per_node) != len(hosts) or sum(tasks_per_node) != world_size:
        raise HpcDdpError(
            f"Slurm's step description does not add up: nodes {hosts}, tasks per node "
            f"{tasks_per_node} (sum {sum(tasks_per_node)}), {world_size} tasks",
            "this usually means stale SLURM_* variables were copied into the environment; "
            "start a fresh step with srun",
        )
    node_name = environ.get("SLURMD_NODENAME")
    node_rank = (
        hosts.index(node_name) if node_name in hosts else read_int(environ, "SLURM_NODEID", 0)
    )
    rank = read_int(environ, "SLURM_PROCID")
    if not 0 <= rank < world_size or not 0 <= node_rank < len(hosts):
        raise HpcDdpError(
            f"SLURM_PROCID={rank} / node {node_rank} do not fit a step of {world_size} tasks "
            f"on {len(hosts)} nodes",
            "start a fresh step with srun",
        )
    port = port_override(environ, configured_port)
    if port is None:
        port = derive_master_port(
            int(re.sub(r"\D", "", job_id) or 0), read_int(environ, "SLURM_STEP_ID")
        )
    return dist_env_from(
        environ,
        hostname,
        "slurm",
        job_id,
        {
            "rank": rank,
            "local_rank": read_int(environ, "SLURM_LOCALID"),
            "world_size": world_size,
            "local_world_size": tasks_per_node[node_rank],
            "node_rank": node_rank,
            "num_nodes": len(hosts),
        },
        master_addr=environ.get("MASTER_ADDR") or hosts[0],
        master_port=port if world_size > 1 else 0,
        restart_count=restart_count,
    )
