"""Where a process sits in a job (:class:`DistEnv`), and reading it from launcher variables.

Pure: everything takes an ``environ`` mapping and nothing here writes it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from hpc_ddp.runtime.errors import HpcDdpError


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
    #: How often the job was requeued (SLURM_RESTART_COUNT); outside Slurm, how often
    #: torchrun restarted the workers.
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
    #: How often torchrun's agent restarted the workers in this allocation
    #: (TORCHELASTIC_RESTART_COUNT; its --max-restarts bounds it).
    elastic_restarts: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs, tracks and writes files."""
        return self.rank == 0


def read_int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
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


def read_count(environ: Mapping[str, str], name: str) -> int | None:
    """Read counts such as SLURM_GPUS_PER_TASK that may carry a type prefix ('a100:1')."""
    raw = environ.get(name)
    if not raw:
        return None
    match = re.search(r"(\d+)$", raw.strip())
    return int(match.group(1)) if match else None


def port_override(environ: Mapping[str, str], configured_port: int | None) -> int | None:
    """Config wins over MASTER_PORT, which wins over the derived port."""
    if configured_port is not None:
        return configured_port
    if environ.get("MASTER_PORT"):
        port = read_int(environ, "MASTER_PORT")
        if not 1 <= port <= 65535:
            raise HpcDdpError(
                f"MASTER_PORT={port} is not a TCP port",
                "set MASTER_PORT to a free port from 1024 to 65535, or unset it",
            )
        return port
    return None


#: Which variable gives which field of the rank's place, per launcher that sets plain numbers,
#: with a default where the launcher may leave it out (None: it must be set). Slurm's place
#: comes from its own notation (:mod:`hpc_ddp.runtime.place.slurm_env`).
PLACE_VARIABLES: dict[str, dict[str, tuple[str, int | str | None]]] = {
    "torchelastic": {
        "rank": ("RANK", None),
        "local_rank": ("LOCAL_RANK", None),
        "world_size": ("WORLD_SIZE", None),
        "local_world_size": ("LOCAL_WORLD_SIZE", None),
        "node_rank": ("GROUP_RANK", 0),
    },
    "local": {
        "rank": ("RANK", None),
        "local_rank": ("LOCAL_RANK", None),
        "world_size": ("WORLD_SIZE", None),
        "local_world_size": ("LOCAL_WORLD_SIZE", "world_size"),  # all ranks on one node
    },
    "submitit-local": {
        "rank": ("SUBMITIT_LOCAL_GLOBALID", 0),
        "local_rank": ("SUBMITIT_LOCAL_LOCALID", 0),
        "world_size": ("SUBMITIT_LOCAL_NTASKS", 1),
    },
}


def read_place(environ: Mapping[str, str], launcher: str) -> dict[str, int]:
    """The place fields ``launcher`` sets, read by :data:`PLACE_VARIABLES` (a default that
    names another field takes that field's value)."""
    place: dict[str, int] = {}
    for field, (variable, default) in PLACE_VARIABLES[launcher].items():
        fallback = place[default] if isinstance(default, str) else default
        place[field] = read_int(environ, variable, fallback)
    return place


def dist_env_from(
    environ: Mapping[str, str],
    hostname: str,
    launcher: str,
    job_id: str,
    place: Mapping[str, int] | None = None,
    *,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    restart_count: int = 0,
    store_hosted_by_launcher: bool = False,
    elastic_restarts: int = 0,
) -> DistEnv:
    """The one way every launcher's reading ends: the ``place`` fields it read (rank,
    local_rank, world_size, local_world_size, node_rank, num_nodes) over those of one process
    on one node, and the CPU and GPU fields every launcher shares."""
    where = {"rank": 0, "local_rank": 0, "world_size": 1, "node_rank": 0, "num_nodes": 1}
    where.update(place or {})
    return DistEnv(
        rank=where["rank"],
        local_rank=where["local_rank"],
        world_size=where["world_size"],
        local_world_size=where.get("local_world_size", where["world_size"]),
        node_rank=where["node_rank"],
        num_nodes=where["num_nodes"],
        master_addr=master_addr,
        master_port=master_port,
        launcher=launcher,
        job_id=job_id,
        restart_count=restart_count,
        hostname=hostname,
        store_hosted_by_launcher=store_hosted_by_launcher,
        elastic_restarts=elastic_restarts,
        cpus_per_task=read_count(environ, "SLURM_CPUS_PER_TASK"),
        gpus_per_task=read_count(environ, "SLURM_GPUS_PER_TASK"),
        cuda_visible_devices=environ.get("CUDA_VISIBLE_DEVICES"),
    )
