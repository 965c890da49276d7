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
from dataclasses import dataclass

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.slurm import derive_master_port, expand_hostlist, expand_tasks_per_node

LOCAL_RUN_ID_VAR = "HPC_DDP_LOCAL_RUN_ID"
SUBMITIT_LOCAL_JOB_VAR = "SUBMITIT_LOCAL_JOB_ID"
LAUNCHER_ORDER = ("torchelastic", "local", "slurm", "submitit-local", "single")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job. Resolved once; passed to everything that needs it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    #: 0 when no rendezvous is needed (world size 1).
    master_port: int
    launcher: str
    job_id: str
    #: How often the job was requeued/restarted (Slurm's SLURM_RESTART_COUNT, else torchrun's).
    restart_count: int
    hostname: str
    #: CPUs Slurm gave this task (SLURM_CPUS_PER_TASK), None outside Slurm.
    cpus_per_task: int | None = None
    #: GPUs bound to each task (SLURM_GPUS_PER_TASK), None when not requested that way.
    gpus_per_task: int | None = None
    #: CUDA_VISIBLE_DEVICES as the launcher set it, None when unset.
    cuda_visible_devices: str | None = None
    #: torchrun's agent already hosts the rendezvous store, so rank 0 must not start one.
    store_hosted_by_launcher: bool = False

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs, tracks and writes files."""
        return self.rank == 0


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise HpcDdpError(
                f"{name} is not set",
                f"the launcher sets {name}: start the job with srun, torchrun or hpc-ddp local",
            )
        return default
    try:
        return int(raw)
    except ValueError:
        raise HpcDdpError(f"{name}={raw!r} is not an integer", f"unset or fix {name}") from None


def _optional_trailing_int(environ: Mapping[str, str], name: str) -> int | None:
    """Read counts such as SLURM_GPUS_PER_TASK that may carry a type prefix ('a100:1')."""
    raw = environ.get(name)
    if not raw:
        return None
    match = re.search(r"(\d+)$", raw.strip())
    return int(match.group(1)) if match else None


def _port_override(environ: Mapping[str, str], configured_port: int | None) -> int | None:
    """Config wins over MASTER_PORT, which wins over the derived port."""
    if configured_port is not None:
        return configured_port
    if environ.get("MASTER_PORT"):
        return _int(environ, "MASTER_PORT")
    return None


def _gpu_fields(environ: Mapping[str, str]) -> dict[str, int | str | None]:
    return {
        "cpus_per_task": _optional_trailing_int(environ, "SLURM_CPUS_PER_TASK"),
        "gpus_per_task": _optional_trailing_int(environ, "SLURM_GPUS_PER_TASK"),
        "cuda_visible_devices": environ.get("CUDA_VISIBLE_DEVICES"),
    }


def _resolve_torchelastic(environ: Mapping[str, str], hostname: str) -> DistEnv:
    world_size = _int(environ, "WORLD_SIZE")
    local_world_size = _int(environ, "LOCAL_WORLD_SIZE")
    restarts = environ.get("SLURM_RESTART_COUNT") or environ.get("TORCHELASTIC_RESTART_COUNT")
    return DistEnv(
        rank=_int(environ, "RANK"),
        local_rank=_int(environ, "LOCAL_RANK"),
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=_int(environ, "GROUP_RANK", 0),
        num_nodes=_int(environ, "GROUP_WORLD_SIZE", max(1, world_size // local_world_size)),
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(environ, "MASTER_PORT"),
        launcher="torchelastic",
        job_id=environ.get("SLURM_JOB_ID") or environ.get("TORCHELASTIC_RUN_ID", "torchrun"),
        restart_count=int(restarts) if restarts and restarts.isdigit() else 0,
        hostname=hostname,
        store_hosted_by_launcher=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        **_gpu_fields(environ),  # type: ignore[arg-type]
    )


def _resolve_local(
    environ: Mapping[str, str], hostname: str, configured_port: int | None
) -> DistEnv:
    world_size = _int(environ, "WORLD_SIZE")
    return DistEnv(
        rank=_int(environ, "RANK"),
        local_rank=_int(environ, "LOCAL_RANK"),
        world_size=world_size,
        local_world_size=_int(environ, "LOCAL_WORLD_SIZE", world_size),
        node_rank=0,
        num_nodes=1,
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=configured_port or _int(environ, "MASTER_PORT"),
        launcher="local",
        job_id=environ[LOCAL_RUN_ID_VAR],
        restart_count=0,
        hostname=hostname,
        **_gpu_fields(environ),  # type: ignore[arg-type]
    )


def _resolve_submitit_local(
    environ: Mapping[str, str], hostname: str, configured_port: int | None
) -> DistEnv:
    job_id = environ[SUBMITIT_LOCAL_JOB_VAR]
    world_size = _int(environ, "SUBMITIT_LOCAL_NTASKS", 1)
    port = _port_override(environ, configured_port)
    if port is None:
        port = derive_master_port(int(re.sub(r"\D", "", job_id) or 0))
    return DistEnv(
        rank=_int(environ, "SUBMITIT_LOCAL_GLOBALID", 0),
        local_rank=_int(environ, "SUBMITIT_LOCAL_LOCALID", 0),
        world_size=world_size,
        local_world_size=world_size,
        node_rank=0,
        num_nodes=1,
        master_addr="127.0.0.1",
        master_port=port if world_size > 1 else 0,
        launcher="submitit-local",
        job_id=f"submitit-{job_id}",
        restart_count=0,
        hostname=hostname,
        **_gpu_fields(environ),  # type: ignore[arg-type]
    )


def _job_task_count(environ: Mapping[str, str]) -> int:
    """Tasks of the whole allocation (not of a step): SLURM_NTASKS, else the tasks-per-node sum."""
    if environ.get("SLURM_NTASKS"):
        return _int(environ, "SLURM_NTASKS")
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


def _resolve_slurm(
    environ: Mapping[str, str],
    hostname: str,
    configured_port: int | None,
    allocation_tasks: int | None,
) -> DistEnv:
    job_id = environ["SLURM_JOB_ID"]
    restart_count = _int(environ, "SLURM_RESTART_COUNT", 0)
    if not environ.get("SLURM_STEP_ID"):
        _reject_unlaunched_allocation(environ, _job_task_count(environ))
        return _single(environ, hostname, "slurm", job_id, restart_count)

    world_size = _int(environ, "SLURM_STEP_NUM_TASKS", _job_task_count(environ))
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
    node_rank = hosts.index(node_name) if node_name in hosts else _int(environ, "SLURM_NODEID", 0)
    rank = _int(environ, "SLURM_PROCID")
    if not 0 <= rank < world_size or not 0 <= node_rank < len(hosts):
        raise HpcDdpError(
            f"SLURM_PROCID={rank} / node {node_rank} do not fit a step of {world_size} tasks "
            f"on {len(hosts)} nodes",
            "start a fresh step with srun",
        )
    port = _port_override(environ, configured_port)
    if port is None:
        port = derive_master_port(
            int(re.sub(r"\D", "", job_id) or 0), _int(environ, "SLURM_STEP_ID")
        )
    return DistEnv(
        rank=rank,
        local_rank=_int(environ, "SLURM_LOCALID"),
        world_size=world_size,
        local_world_size=tasks_per_node[node_rank],
        node_rank=node_rank,
        num_nodes=len(hosts),
        master_addr=environ.get("MASTER_ADDR") or hosts[0],
        master_port=port if world_size > 1 else 0,
        launcher="slurm",
        job_id=job_id,
        restart_count=restart_count,
        hostname=hostname,
        **_gpu_fields(environ),  # type: ignore[arg-type]
    )


def _single(
    environ: Mapping[str, str], hostname: str, launcher: str, job_id: str, restart_count: int
) -> DistEnv:
    return DistEnv(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        node_rank=0,
        num_nodes=1,
        master_addr="127.0.0.1",
        master_port=0,
        launcher=launcher,
        job_id=job_id,
        restart_count=restart_count,
        hostname=hostname,
        **_gpu_fields(environ),  # type: ignore[arg-type]
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
        return _resolve_torchelastic(environ, host)
    if launcher == "local":
        return _resolve_local(environ, host, configured_port)
    if launcher == "slurm":
        return _resolve_slurm(environ, host, configured_port, allocation_tasks)
    if launcher == "submitit-local":
        return _resolve_submitit_local(environ, host, configured_port)
    return _single(environ, host, "single", single_run_id, 0)


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
