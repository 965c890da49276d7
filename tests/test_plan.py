"""Batch division, worker counts and GPU choice: the fail-fast checks before any process group."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.runtime.config import DistConfig, RunConfig
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.place.env import DistEnv
from hpc_ddp.runtime.place.plan import (
    SPAWN_NPROCS_VAR,
    gpu_binding_warning,
    launch_lines,
    make_launch_plan,
    micro_batch_size,
    plan_device,
    resolve_num_workers,
    stale_spawn_world,
)


def dist_env(**fields: Any) -> DistEnv:
    base = DistEnv(
        rank=1,
        local_rank=1,
        world_size=4,
        local_world_size=2,
        node_rank=0,
        num_nodes=2,
        master_addr="node1",
        master_port=12345,
        launcher="slurm",
        job_id="7",
        restart_count=0,
        hostname="node1",
    )
    return replace(base, **fields)


def test_batch_divides_over_ranks_and_accumulation() -> None:
    assert micro_batch_size(256, 4, 2) == 32
    assert micro_batch_size(96, 3, 1) == 32


def test_batch_that_does_not_divide_lists_the_world_sizes_that_work() -> None:
    with pytest.raises(HpcDdpError) as caught:
        micro_batch_size(100, 3, 1)
    message = str(caught.value)
    assert "batch_size=100 (global) does not divide over world_size=3" in message
    assert "world sizes that work with this batch: 1, 2, 4, 5, 10, 20, 25, 50, 100" in message


def test_workers() -> None:
    assert resolve_num_workers(3, 8, 64, 4) == 3
    assert resolve_num_workers("auto", 8, 64, 4) == 7
    assert resolve_num_workers("auto", None, 16, 4) == 3
    assert resolve_num_workers("auto", None, 2, 4) == 0


def cuda_config() -> DistConfig:
    return DistConfig(device="cuda")


def test_gpus_per_task_uses_cuda0_and_nccl() -> None:
    """Mocked GPU count: a GPU cannot exist on the test machines."""
    env = dist_env(gpus_per_task=1, cuda_visible_devices="1")
    plan = plan_device(DistConfig(), env, cuda_device_count=1)
    assert (plan.device, plan.backend) == ("cuda:0", "nccl")


def test_per_task_gpus_on_a_multi_gpu_node_warn_that_nccl_loses_peer_to_peer() -> None:
    """Mocked GPU count: a GPU cannot exist on the test machines."""
    bound = dist_env(gpus_per_task=1, cuda_visible_devices="1")
    warning = gpu_binding_warning(bound, plan_device(cuda_config(), bound, cuda_device_count=1))
    assert warning is not None
    assert "each of the 2 tasks on node node1 sees only its own GPU" in warning
    assert "HINT: request --gpus-per-node=2 with --ntasks-per-node=2" in warning
    shared = dist_env(cuda_visible_devices="0,1")
    assert gpu_binding_warning(shared, plan_device(cuda_config(), shared, 2)) is None
    alone = dist_env(gpus_per_task=1, local_world_size=1, local_rank=0, cuda_visible_devices="0")
    assert gpu_binding_warning(alone, plan_device(cuda_config(), alone, 1)) is None
    cpu = dist_env(gpus_per_task=1)
    assert gpu_binding_warning(cpu, plan_device(DistConfig(), cpu, 0)) is None


def test_gres_with_one_gpu_per_local_task_uses_local_rank() -> None:
    plan = plan_device(cuda_config(), dist_env(cuda_visible_devices="0,1"), cuda_device_count=0)
    assert (plan.device, plan.backend) == ("cuda:1", "nccl")


def test_more_tasks_than_gpus_fails_fast() -> None:
    env = dist_env(local_world_size=4, local_rank=3, cuda_visible_devices="0,1")
    with pytest.raises(HpcDdpError, match="4 tasks on node node1 but only 2 visible GPU"):
        plan_device(cuda_config(), env, cuda_device_count=2)


def test_more_local_ranks_than_gpus_names_the_local_fix_not_slurms() -> None:
    env = dist_env(launcher="local", local_world_size=2, local_rank=1, cuda_visible_devices=None)
    with pytest.raises(HpcDdpError) as caught:
        plan_device(cuda_config(), env, cuda_device_count=1)
    assert "hpc-ddp local --nproc 1" in str(caught.value) and "dist.device=cpu" in str(caught.value)
    assert "--ntasks-per-node" not in str(caught.value)


def test_idle_gpus_under_slurm_are_an_error() -> None:
    with pytest.raises(HpcDdpError, match="2 would sit idle") as caught:
        plan_device(cuda_config(), dist_env(), cuda_device_count=4)
    assert "--ntasks-per-node=4 with --gpus-per-node=4" in str(caught.value)


def test_torchrun_with_more_gpus_uses_local_rank() -> None:
    plan = plan_device(cuda_config(), dist_env(launcher="torchelastic"), cuda_device_count=8)
    assert plan.device == "cuda:1"


def test_several_gpus_per_task_is_refused() -> None:
    with pytest.raises(HpcDdpError, match="each rank drives exactly one GPU"):
        plan_device(cuda_config(), dist_env(gpus_per_task=2), cuda_device_count=2)


def test_cpu_and_gloo_without_gpus_and_errors_when_cuda_is_forced() -> None:
    plan = plan_device(DistConfig(), dist_env(), cuda_device_count=0)
    assert (plan.device, plan.backend) == ("cpu", "gloo")
    with pytest.raises(HpcDdpError, match="no GPU is visible"):
        plan_device(cuda_config(), dist_env(), cuda_device_count=0)
    with pytest.raises(HpcDdpError, match="nccl needs CUDA"):
        plan_device(DistConfig(backend="nccl"), dist_env(), cuda_device_count=0)


def test_launch_plan_run_dir_uses_job_id(tmp_path: Path) -> None:
    run = RunConfig(output_dir=str(tmp_path))
    plan = make_launch_plan(DistConfig(), run, "digits-mlp", dist_env(), cuda_device_count=0)
    assert plan.run_dir == tmp_path / "digits-mlp" / "7"
    assert plan.device.device == "cpu"
    fixed = make_launch_plan(DistConfig(), RunConfig(id="mine"), "x", dist_env(), 0)
    assert fixed.run_dir == Path("runs") / "x" / "mine"


def test_the_start_line_names_an_array_task_as_squeue_does_and_keeps_its_id() -> None:
    plan = make_launch_plan(DistConfig(), RunConfig(), "x", dist_env(job_id="36"), 0)
    task = {"SLURM_JOB_ID": "36", "SLURM_ARRAY_JOB_ID": "34", "SLURM_ARRAY_TASK_ID": "1"}
    assert launch_lines(plan, task)[0].startswith("job 34_1 (id 36) (slurm): 4 rank(s) on 2")
    assert launch_lines(plan, {"SLURM_JOB_ID": "36"})[0].startswith("job 36 (slurm): ")
    assert launch_lines(plan)[0].startswith("job 36 (slurm): ")
    # hpc-ddp local inside an array task's allocation: its ranks are not that job's.
    local = make_launch_plan(DistConfig(), RunConfig(), "x", dist_env(job_id="local-9"), 0)
    assert launch_lines(local, task)[0].startswith("job local-9 (slurm): ")


def split(k: int = 2) -> DistConfig:
    return DistConfig(device="cuda", gpus_per_rank=k)


def test_a_rank_over_k_gpus_gets_its_own_k_in_both_slurm_layouts() -> None:
    """Mocked GPU counts (CUDA_VISIBLE_DEVICES as Slurm sets it): no GPU here."""
    shared = plan_device(split(), dist_env(cuda_visible_devices="0,1,2,3"), 0)
    assert shared.devices == ("cuda:2", "cuda:3") and shared.device == "cuda:2"
    assert "2 per rank by LOCAL_RANK" in shared.reason
    own = plan_device(split(), dist_env(gpus_per_task=2, cuda_visible_devices="5,6"), 0)
    assert own.devices == ("cuda:0", "cuda:1") and "--gpus-per-task=2" in own.reason
    elastic = plan_device(split(), dist_env(launcher="torchelastic"), cuda_device_count=8)
    assert elastic.devices == ("cuda:2", "cuda:3")
    alone = plan_device(split(3), dist_env(local_rank=0, local_world_size=1), 3)
    assert alone.devices == ("cuda:0", "cuda:1", "cuda:2")
    cpu = plan_device(DistConfig(gpus_per_rank=2), dist_env(), cuda_device_count=0)
    assert cpu.devices == ("cpu", "cpu")


def test_layouts_that_do_not_give_every_rank_k_gpus_are_refused() -> None:
    with pytest.raises(HpcDdpError, match="gpus_per_rank=2 need 4 GPUs, but 2 are visible"):
        plan_device(split(), dist_env(cuda_visible_devices="0,1"), 0)
    with pytest.raises(HpcDdpError, match="--gpus-per-task=1; each rank drives exactly 2 GPUs"):
        plan_device(split(), dist_env(gpus_per_task=1, cuda_visible_devices="0"), 0)
    with pytest.raises(HpcDdpError, match="4 would sit idle") as idle:
        plan_device(split(), dist_env(cuda_visible_devices="0,1,2,3,4,5,6,7"), 0)
    assert "--ntasks-per-node=4 with --gpus-per-node=8" in str(idle.value)
    with pytest.raises(HpcDdpError, match=r"dist\.gpus_per_rank=0 is invalid"):
        DistConfig(gpus_per_rank=0)


def test_a_spawn_asking_for_another_world_size_than_the_launchers_is_named() -> None:
    asked_three = {SPAWN_NPROCS_VAR: "3"}
    warning = stale_spawn_world(asked_three, 2)
    assert warning is not None and "nprocs=3) under a launcher that started 2 ranks" in warning
    assert "HINT: inside main use run.world_size (here 2)" in warning
    assert stale_spawn_world(asked_three, 3) is None
    assert stale_spawn_world({}, 2) is None, "no spawn, nothing to compare"
