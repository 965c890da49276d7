"""Which GPUs a rank drives: one (plain data parallelism) or ``k`` (a model split over k
GPUs inside the rank, DDP across ranks), from what Slurm, torchrun or the local launcher
made visible. Pure arithmetic over the :class:`~hpc_ddp.runtime.place.env.DistEnv`.

The layouts that give every rank its own k GPUs:

- ``--ntasks-per-node=T --gpus-per-node=k*T``: each task sees the node's k*T GPUs and drives
  ``local_rank*k .. local_rank*k+k-1``;
- ``--gpus-per-task=k``: each task sees only its own k GPUs, ``cuda:0 .. cuda:k-1``;
- torchrun (or any launcher but Slurm) with at least ``k * local ranks`` GPUs visible.

Every other layout is refused with a HINT before any process group.
"""

from __future__ import annotations

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.place.env import DistEnv


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


def _by_local_rank(env: DistEnv, k: int) -> list[int]:
    return list(range(env.local_rank * k, env.local_rank * k + k))


def cuda_indices(env: DistEnv, visible: int, k: int = 1) -> tuple[list[int], str]:
    """The visible GPUs (indices) this rank drives, and why (see the module docstring)."""
    per_node = env.local_world_size
    each = "one GPU" if k == 1 else f"{k} GPUs"
    if env.gpus_per_task is not None:
        if env.gpus_per_task != k or visible != k:
            raise HpcDdpError(
                f"this task sees {visible} GPU(s) with --gpus-per-task={env.gpus_per_task}; "
                f"each rank drives exactly {each} (dist.gpus_per_rank={k})",
                f"request --gpus-per-task={k}, or set dist.gpus_per_rank={env.gpus_per_task} "
                "for a model split over that many GPUs",
            )
        if k == 1:
            return [0], "--gpus-per-task=1: this task's own GPU is cuda:0"
        return list(range(k)), f"--gpus-per-task={k}: this task's own GPUs cuda:0-{k - 1}"
    needed = per_node * k
    if visible == k and per_node == 1:
        return list(range(k)), "one task, one GPU" if k == 1 else f"one task, {k} GPUs"
    if visible == needed:
        reason = (
            f"{visible} GPUs shared by {per_node} tasks: cuda:LOCAL_RANK"
            if k == 1
            else f"{visible} GPUs shared by {per_node} tasks: {k} per rank by LOCAL_RANK"
        )
        return _by_local_rank(env, k), reason
    if visible < needed:
        if k == 1:
            raise HpcDdpError(
                f"{per_node} tasks on node {env.hostname} but only {visible} visible GPU(s)",
                f"start at most {visible} local rank(s) (`hpc-ddp local --nproc {visible}`), "
                "or CPU ranks with dist.device=cpu"
                if env.launcher == "local"
                else "run one task per GPU: --ntasks-per-node equal to --gpus-per-node "
                "(`hpc-ddp render --gpus-per-node N` writes both)",
            )
        raise HpcDdpError(
            f"{per_node} tasks on node {env.hostname} with dist.gpus_per_rank={k} need "
            f"{needed} GPUs, but {visible} are visible",
            f"request --gpus-per-node={needed} with --ntasks-per-node={per_node}, or "
            f"--gpus-per-task={k}",
        )
    if env.launcher == "slurm":
        raise HpcDdpError(
            f"{visible} GPUs visible to each of the {per_node} task(s) on node "
            f"{env.hostname}: {visible - needed} would sit idle, and the task-to-GPU "
            "mapping is ambiguous",
            f"use --ntasks-per-node={visible // k} with --gpus-per-node={visible} (or "
            f"--gres=gpu:{visible}): {each} per task",
        )
    mapping = "cuda:LOCAL_RANK" if k == 1 else f"{k} each by LOCAL_RANK"
    return _by_local_rank(env, k), f"{visible} GPUs visible, {per_node} local ranks: {mapping}"
