"""Which GPUs a rank drives: one (plain data parallelism) or ``k`` (a model split over k
GPUs inside the rank, DDP across ranks), from what Slurm, torchrun or the local launcher
made visible. Pure arithmetic over the :class:`~hpc_ddp.runtime.place.env.DistEnv`.

The layouts that give every rank its own k GPUs:

- ``--ntasks-per-node=T --gpus-per-node=k*T``: each task sees the node's k*T GPUs and drives
  ``local_rank*k .. local_rank*k+k-1``;
- ``--gpus-per-task=k``: each task sees only its own k GPUs, ``cuda:0 .. cuda:k-1``;
- torchrun (or any launcher but Slurm) with at least ``k * local ranks`` GPUs visible;
- MIG slices (``CUDA_VISIBLE_DEVICES=MIG-...``), one per rank: CUDA shows a process one slice
  only, so where the node's tasks share a list of slices, each rank keeps the slice at its
  local rank (:func:`own_mig_slice`) before CUDA starts, and drives it as ``cuda:0``.

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


def mig_slices(cuda_visible_devices: str | None) -> list[str]:
    """The MIG slices ``CUDA_VISIBLE_DEVICES`` names, in order (``MIG-<uuid>``, or the older
    ``MIG-GPU-<uuid>/<gi>/<ci>``); [] where it names whole GPUs or nothing."""
    entries = [item.strip() for item in (cuda_visible_devices or "").split(",") if item.strip()]
    return [entry for entry in entries if entry.startswith("MIG-")]


def own_mig_slice(env: DistEnv) -> str | None:
    """The one MIG slice this rank keeps where the node's tasks share a list of them (the
    slice at its local rank); None where CUDA_VISIBLE_DEVICES names one slice or none."""
    slices = mig_slices(env.cuda_visible_devices)
    if len(slices) < 2 or len(slices) != env.local_world_size:
        return None
    return slices[env.local_rank]


def check_kept_slice(own: str, seen: str, slices: list[str]) -> None:
    """Refuse a rank whose CUDA shows another slice of the list than the one it kept
    (``seen``: ``MIG-`` and the UUID CUDA gives): CUDA had started before the rank kept its
    own, so every rank of the node would train on the same slice."""
    if seen in slices and seen != own:
        raise HpcDdpError(
            f"this rank was to drive MIG slice {own} (its local rank's), but CUDA shows "
            f"{seen}: CUDA started before hpc_ddp.start() and took the first slice of "
            "CUDA_VISIBLE_DEVICES, so the node's ranks would share one slice",
            "call hpc_ddp.start() before any torch.cuda call (torch.cuda.is_available() "
            "starts CUDA), or have Slurm give each task its own slice (srun "
            "--gpus-per-task=1)",
        )


def _mig_placement(env: DistEnv, slices: list[str], k: int) -> tuple[list[int], str]:
    if k != 1:
        raise HpcDdpError(
            f"dist.gpus_per_rank={k} with MIG slices ({', '.join(slices)}): CUDA shows a "
            "process one MIG slice only",
            "set dist.gpus_per_rank=1 (one slice per rank), or request whole GPUs",
        )
    if len(slices) == 1:
        return [0], f"this rank's MIG slice {slices[0]} is cuda:0"
    if len(slices) == env.local_world_size:
        return [0], (
            f"{len(slices)} MIG slices shared by {env.local_world_size} tasks: this rank keeps "
            f"slice LOCAL_RANK ({slices[env.local_rank]}) as cuda:0"
        )
    raise HpcDdpError(
        f"{len(slices)} MIG slices visible to each of the {env.local_world_size} task(s) on "
        f"node {env.hostname}: CUDA shows a process one slice only, so the tasks cannot "
        "share them out",
        f"run one task per slice: --ntasks-per-node={len(slices)}, or request "
        f"{env.local_world_size} slice(s) per node",
    )


def _by_local_rank(env: DistEnv, k: int) -> list[int]:
    return list(range(env.local_rank * k, env.local_rank * k + k))


def cuda_indices(env: DistEnv, visible: int, k: int = 1) -> tuple[list[int], str]:
    """The visible GPUs (indices) this rank drives, and why (see the module docstring)."""
    if slices := mig_slices(env.cuda_visible_devices):
        return _mig_placement(env, slices, k)
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
