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


def gpu_fields(environ: Mapping[str, str]) -> dict[str, int | str | None]:
    return {
        "cpus_per_task": read_count(environ, "SLURM_CPUS_PER_TASK"),
        "gpus_per_task": read_count(environ, "SLURM_GPUS_PER_TASK"),
        "cuda_visible_devices": environ.get("CUDA_VISIBLE_DEVICES"),
    }
