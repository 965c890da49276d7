"""The resolved plan of a launch: device, run directory, batch division, workers.

Pure arithmetic over the settings and the :class:`~hpc_ddp.runtime.place.env.DistEnv`. Everything
that can be wrong about a launch is checked here, before any process group exists, so a bad
request fails in seconds with a HINT instead of hanging inside NCCL or gloo.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.runtime.config import DistConfig, RunConfig
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.place.env import DistEnv
from hpc_ddp.runtime.place.gpus import cuda_indices, visible_gpu_count
from hpc_ddp.runtime.place.rundir import check_plain_name
from hpc_ddp.runtime.place.slurm import queue_job_id


@dataclass(frozen=True)
class DevicePlan:
    """The torch device this rank uses and the process-group backend."""

    device: str
    backend: str
    #: Why this device: shown by `hpc-ddp doctor`.
    reason: str
    #: Every device this rank drives (``device`` first); several with dist.gpus_per_rank > 1.
    devices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.devices:
            object.__setattr__(self, "devices", (self.device,))


@dataclass(frozen=True)
class LaunchPlan:
    """Where this rank runs, what it drives and where it writes: derived before any
    process group exists."""

    dist_env: DistEnv
    device: DevicePlan
    run_dir: Path


def micro_batch_size(
    global_batch: int,
    world_size: int,
    grad_accum_steps: int,
    names: tuple[str, str] = ("batch_size", "grad_accum_steps"),
) -> int:
    """Samples each rank loads per micro-step; refuses a global batch that does not divide.

    ``names`` are what the caller calls the batch and accumulation settings, for the message.
    """
    batch_name, accum_name = names
    if global_batch < 1 or grad_accum_steps < 1:
        raise HpcDdpError(
            f"{batch_name}={global_batch}, {accum_name}={grad_accum_steps}: both must be >= 1",
            f"set {batch_name} to the global batch: samples per optimizer step over all ranks",
        )
    shares = world_size * grad_accum_steps
    if global_batch % shares:
        working = [
            w
            for w in range(1, min(global_batch, 1024) + 1)
            if global_batch % (w * grad_accum_steps) == 0
        ]
        raise HpcDdpError(
            f"{batch_name}={global_batch} (global) does not divide over world_size="
            f"{world_size} x {accum_name}={grad_accum_steps}",
            f"world sizes that work with this batch: {', '.join(map(str, working)) or 'none'}; "
            f"or pick {batch_name} as a multiple of {shares}",
        )
    return global_batch // shares


def resolve_num_workers(
    setting: int | str, cpus_per_task: int | None, cpu_count: int, local_world_size: int
) -> int:
    """DataLoader workers per rank; 'auto' gives each rank its CPU share minus the main process."""
    if setting != "auto":
        return int(setting)
    cpus_for_this_rank = cpus_per_task or max(1, cpu_count // max(1, local_world_size))
    return max(0, cpus_for_this_rank - 1)


def threads_per_rank(cpu_count: int, ranks: int) -> int:
    """Intra-op threads for each of ``ranks`` ranks sharing ``cpu_count`` CPUs (at least 1)."""
    return max(1, cpu_count // ranks)


def gpu_binding_warning(dist_env: DistEnv, device: DevicePlan) -> str | None:
    """A warning when each task of a multi-GPU node sees only its own GPU (--gpus-per-task).

    Training works, but NCCL then cannot use CUDA IPC between the node's GPUs, so gradients
    travel through host memory instead of NVLink or PCIe peer-to-peer; Slurm releases that
    also confine each task's devices to its own GPU hide the peers completely.
    """
    bound_to_own_gpu = device.device.startswith("cuda") and dist_env.gpus_per_task is not None
    if not bound_to_own_gpu or dist_env.local_world_size < 2:
        return None
    return (
        f"--gpus-per-task={dist_env.gpus_per_task}: each of the {dist_env.local_world_size} "
        f"tasks on node {dist_env.hostname} sees only its own GPU, so NCCL cannot exchange "
        "gradients directly between them (no CUDA IPC; traffic goes through host memory). "
        f"HINT: request --gpus-per-node={dist_env.local_world_size} with "
        f"--ntasks-per-node={dist_env.local_world_size} instead (as slurm/train.sh does)"
    )


def plan_device(config: DistConfig, dist_env: DistEnv, cuda_device_count: int) -> DevicePlan:
    """Choose the device and backend. ``cuda_device_count`` is torch.cuda.device_count()."""
    wanted = config.device
    visible = visible_gpu_count(dist_env.cuda_visible_devices, cuda_device_count)
    use_cuda = wanted == "cuda" or (wanted == "auto" and cuda_device_count > 0)
    if use_cuda and visible == 0:
        raise HpcDdpError(
            "dist.device=cuda but no GPU is visible to this process",
            "request GPUs from Slurm (--gpus-per-node / --gres=gpu:N), check CUDA_VISIBLE_DEVICES, "
            "or use dist.device=cpu",
        )
    if config.backend == "nccl" and not use_cuda:
        raise HpcDdpError(
            "dist.backend=nccl needs CUDA devices, and this process has none",
            "use dist.backend=auto (gloo on CPU)",
        )
    k = config.gpus_per_rank
    if not use_cuda:
        backend = "gloo" if config.backend == "auto" else config.backend
        reason = "no GPU visible" if wanted == "auto" else "dist.device=cpu"
        return DevicePlan("cpu", backend, reason, ("cpu",) * k)
    indices, reason = cuda_indices(dist_env, visible, k)
    backend = "nccl" if config.backend == "auto" else config.backend
    devices = tuple(f"cuda:{index}" for index in indices)
    return DevicePlan(devices[0], backend, reason, devices)


def run_directory(config: RunConfig, name: str, dist_env: DistEnv) -> Path:
    """<output_dir>/<name>/<id>: the id is the Slurm job id, so a requeued job finds its files."""
    run_id = config.id or dist_env.job_id
    folder = check_plain_name(run_id, "run.id" if config.id else "the job id")
    return Path(config.output_dir) / check_plain_name(name, "run.name") / folder


def make_launch_plan(
    config: DistConfig, run: RunConfig, name: str, dist_env: DistEnv, cuda_device_count: int
) -> LaunchPlan:
    """Derive and check the device and run directory; raises HpcDdpError with a HINT."""
    return LaunchPlan(
        dist_env=dist_env,
        device=plan_device(config, dist_env, cuda_device_count),
        run_dir=run_directory(run, name, dist_env),
    )


def describe_launch(plan: LaunchPlan) -> str:
    """This rank's place, device and run directory, in one line (logs, `--dry-run`, doctor)."""
    env = plan.dist_env
    return (
        f"launcher={env.launcher} job={env.job_id} host={env.hostname} rank={env.rank}/"
        f"{env.world_size} local_rank={env.local_rank}/{env.local_world_size} node={env.node_rank}/"
        f"{env.num_nodes} master={env.master_addr}:{env.master_port} "
        f"device={','.join(plan.device.devices)} "
        f"({plan.device.reason}) backend={plan.device.backend} cuda_visible="
        f"{env.cuda_visible_devices or '-'} run_dir={plan.run_dir}"
    )


def launch_lines(plan: LaunchPlan, environ: Mapping[str, str] | None = None) -> list[str]:
    """Rank 0's start lines for a terminal: the job (an array task as squeue names it,
    ``34_1``, where the ranks are that Slurm job's), the devices, the run directory, each
    short enough not to wrap (the one-line form for reports is :func:`describe_launch`)."""
    env, device = plan.dist_env, plan.device
    queue_job = queue_job_id(environ or {})
    in_slurm = (environ or {}).get("SLURM_JOB_ID") == env.job_id  # not a local run inside one
    job = env.job_id
    if in_slurm and queue_job != env.job_id:
        job = f"{queue_job} (id {env.job_id})"
    return [
        f"job {job} ({env.launcher}): {env.world_size} rank(s) on {env.num_nodes} "
        f"node(s), master {env.master_addr}:{env.master_port}",
        f"device {','.join(device.devices)} ({device.reason}), backend {device.backend}, "
        f"CUDA_VISIBLE_DEVICES {env.cuda_visible_devices or 'unset'}",
        f"run directory {plan.run_dir}",
    ]


def check_socket_interfaces(environ: Mapping[str, str], interfaces: Sequence[str]) -> None:
    """Refuse GLOO_SOCKET_IFNAME naming an interface this host does not have (gloo would
    fail deep inside process-group creation); ``interfaces``: this host's names."""
    named = environ.get("GLOO_SOCKET_IFNAME", "")
    missing = [name for name in named.split(",") if name and name not in interfaces]
    if missing:
        raise HpcDdpError(
            f"GLOO_SOCKET_IFNAME={named} names no network interface of this host: "
            f"{', '.join(missing)} (it has {', '.join(interfaces) or 'none'})",
            "unset GLOO_SOCKET_IFNAME, or name interfaces every node has (e.g. ib0 or eth0)",
        )


#: Set by :func:`hpc_ddp.spawn` under a launcher: the ``nprocs`` the script passed.
SPAWN_NPROCS_VAR = "HPC_DDP_SPAWN_NPROCS"


def stale_spawn_world(environ: Mapping[str, str], world_size: int) -> str | None:
    """The warning for a script whose ``hpc_ddp.spawn(..., nprocs=N)`` asked for another
    number of ranks than the launcher started (``world_size``); None when they agree."""
    asked = environ.get(SPAWN_NPROCS_VAR, "")
    if not asked.isdigit() or int(asked) == world_size:
        return None
    return (
        f"hpc_ddp.spawn(..., nprocs={asked}) under a launcher that started {world_size} ranks: "
        f"the launcher's {world_size} run main, so a world size the script computed before "
        f"the launch (and passed in args) is not this run's. HINT: inside main use "
        f"run.world_size (here {world_size}) and run.rank, e.g. to divide the global batch"
    )
