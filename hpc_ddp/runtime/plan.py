"""The resolved plan of a launch: device, run directory, batch division, workers.

Pure arithmetic over the settings and the :class:`~hpc_ddp.runtime.env.DistEnv`. Everything
that can be wrong about a launch is checked here, before any process group exists, so a bad
request fails in seconds with a HINT instead of hanging inside NCCL or gloo.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.runtime.config import DistConfig, RunConfig
from hpc_ddp.runtime.env import DistEnv
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.rundir import check_plain_name


@dataclass(frozen=True)
class DevicePlan:
    """The torch device this rank uses and the process-group backend."""

    device: str
    backend: str
    #: Why this device: shown by `hpc-ddp doctor`.
    reason: str


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


def visible_gpu_count(cuda_visible_devices: str | None, cuda_device_count: int) -> int:
    """GPUs this process can use: torch's count, else what CUDA_VISIBLE_DEVICES names.

    The second form lets `hpc-ddp doctor` plan GPU placement on a node whose torch build
    cannot see the devices (or before CUDA is initialised).
    """
    if cuda_device_count > 0:
        return cuda_device_count
    if cuda_visible_devices is None:
        return 0
    return len([item for item in cuda_visible_devices.split(",") if item.strip() and item != "-1"])


def _cuda_index(dist_env: DistEnv, visible: int) -> tuple[int, str]:
    """Which of the visible GPUs this rank drives (see the README's GPU section)."""
    per_node = dist_env.local_world_size
    if dist_env.gpus_per_task is not None:
        if dist_env.gpus_per_task != 1 or visible != 1:
            raise HpcDdpError(
                f"this task sees {visible} GPU(s) with --gpus-per-task={dist_env.gpus_per_task}; "
                "DDP drives exactly one GPU per task",
                "request --gpus-per-task=1 with one task per GPU (--ntasks-per-node=GPUs per node)",
            )
        return 0, "--gpus-per-task=1: this task's own GPU is cuda:0"
    if visible == per_node:
        return dist_env.local_rank, f"{visible} GPUs shared by {per_node} tasks: cuda:LOCAL_RANK"
    if visible == 1 and per_node == 1:
        return 0, "one task, one GPU"
    if visible < per_node:
        raise HpcDdpError(
            f"{per_node} tasks on node {dist_env.hostname} but only {visible} visible GPU(s)",
            "run one task per GPU: --ntasks-per-node equal to --gpus-per-node "
            "(`hpc-ddp render --gpus-per-node N` writes both)",
        )
    if dist_env.launcher == "slurm":
        raise HpcDdpError(
            f"{visible} GPUs visible to each of the {per_node} task(s) on node "
            f"{dist_env.hostname}: {visible - per_node} would sit idle, and the task-to-GPU "
            "mapping is ambiguous",
            f"use --ntasks-per-node={visible} with --gpus-per-node={visible} (or "
            f"--gres=gpu:{visible}): one task per GPU",
        )
    return dist_env.local_rank, f"{visible} GPUs visible, {per_node} local ranks: cuda:LOCAL_RANK"


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
    if not use_cuda:
        backend = "gloo" if config.backend == "auto" else config.backend
        return DevicePlan(
            "cpu", backend, "no GPU visible" if wanted == "auto" else "dist.device=cpu"
        )
    index, reason = _cuda_index(dist_env, visible)
    backend = "nccl" if config.backend == "auto" else config.backend
    return DevicePlan(f"cuda:{index}", backend, reason)


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
        f"{env.num_nodes} master={env.master_addr}:{env.master_port} device={plan.device.device} "
        f"({plan.device.reason}) backend={plan.device.backend} cuda_visible="
        f"{env.cuda_visible_devices or '-'} run_dir={plan.run_dir}"
    )
