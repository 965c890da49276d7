"""DistEnv resolution from plain environment dicts: Slurm, torchrun, local, single."""

from __future__ import annotations

import os

import pytest

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.place.distenv import port_override
from hpc_ddp.runtime.place.env import (
    LAUNCHER_ORDER,
    detect_launcher,
    dist_env_variables,
    export_dist_env,
    needs_allocation_task_count,
    resolve_dist_env,
    with_agreed_elastic_restarts,
)
from hpc_ddp.runtime.place.slurm import derive_master_port


def slurm_step(**overrides: str) -> dict[str, str]:
    """Rank 5 of `srun -N2 --ntasks-per-node=4` on gpu[001-002], as Slurm sets it."""
    environ = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "8",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_NODELIST": "gpu[001-002]",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "SLURM_STEP_NODELIST": "gpu[001-002]",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURMD_NODENAME": "gpu002",
        "SLURM_CPUS_PER_TASK": "8",
    }
    environ.update(overrides)
    return environ


def test_slurm_step_resolves_every_field() -> None:
    env = resolve_dist_env(slurm_step(), hostname="gpu002")
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (5, 1, 8, 4)
    assert (env.node_rank, env.num_nodes) == (1, 2)
    assert env.master_addr == "gpu001"
    assert env.master_port == derive_master_port(4242, 0)
    assert (env.launcher, env.job_id, env.restart_count) == ("slurm", "4242", 0)
    assert env.cpus_per_task == 8
    assert not env.is_main


def test_step_variables_win_over_job_variables() -> None:
    """A 3-task step on 2 nodes inside a bigger allocation: the step describes this srun."""
    environ = slurm_step(
        SLURM_NTASKS="16",
        SLURM_TASKS_PER_NODE="8(x2)",
        SLURM_JOB_NODELIST="gpu[001-002]",
        SLURM_STEP_NUM_TASKS="3",
        SLURM_STEP_TASKS_PER_NODE="2,1",
        SLURM_PROCID="2",
        SLURM_LOCALID="0",
    )
    env = resolve_dist_env(environ, hostname="gpu002")
    assert (env.world_size, env.local_world_size, env.node_rank) == (3, 1, 1)


def test_job_variables_are_the_fallback_without_step_variables() -> None:
    environ = slurm_step()
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NODELIST"):
        del environ[name]
    env = resolve_dist_env(environ, hostname="gpu002")
    assert (env.world_size, env.local_world_size, env.master_addr) == (8, 4, "gpu001")


def test_uneven_tasks_per_node() -> None:
    environ = slurm_step(
        SLURM_STEP_NUM_TASKS="7",
        SLURM_STEP_TASKS_PER_NODE="2(x3),1",
        SLURM_STEP_NODELIST="rack[1-2]-node[01-02]",
        SLURMD_NODENAME="rack2-node02",
        SLURM_PROCID="6",
        SLURM_LOCALID="0",
    )
    env = resolve_dist_env(environ, hostname="x")
    assert (env.node_rank, env.num_nodes, env.local_world_size) == (3, 4, 1)
    assert env.master_addr == "rack1-node01"


def test_port_overrides_config_then_environment_then_derived() -> None:
    assert resolve_dist_env(slurm_step(MASTER_PORT="23456"), hostname="h").master_port == 23456
    assert (
        resolve_dist_env(
            slurm_step(MASTER_PORT="23456"), configured_port=31000, hostname="h"
        ).master_port
        == 31000
    )
    assert resolve_dist_env(slurm_step(), hostname="h").master_port == derive_master_port(4242, 0)


def test_restart_count_and_gpu_fields() -> None:
    environ = slurm_step(
        SLURM_RESTART_COUNT="2", SLURM_GPUS_PER_TASK="a100:1", CUDA_VISIBLE_DEVICES="1"
    )
    env = resolve_dist_env(environ, hostname="h")
    assert (env.restart_count, env.gpus_per_task, env.cuda_visible_devices) == (2, 1, "1")


def test_not_started_by_srun_in_a_multi_task_allocation_fails_fast() -> None:
    environ = {
        "SLURM_JOB_ID": "77",
        "SLURM_NTASKS": "2",
        "SLURM_TASKS_PER_NODE": "2",
        "SLURM_JOB_NODELIST": "node1",
        "SLURMD_NODENAME": "node1",
    }
    with pytest.raises(HpcDdpError) as caught:
        resolve_dist_env(environ, hostname="node1")
    message = str(caught.value)
    assert "not started by srun" in message
    assert "a batch script" in message
    assert "wait forever for the other 1" in message
    assert "HINT: start training with `srun python train.py" in message


def test_salloc_shell_is_named_in_the_error() -> None:
    environ = {"SLURM_JOB_ID": "78", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "node[1-2]"}
    with pytest.raises(HpcDdpError, match="an salloc shell"):
        resolve_dist_env(environ, hostname="login1")


def test_one_task_batch_script_runs_as_a_single_rank() -> None:
    environ = {"SLURM_JOB_ID": "79", "SLURM_NTASKS": "1", "SLURMD_NODENAME": "node1"}
    env = resolve_dist_env(environ, hostname="node1")
    assert (env.launcher, env.world_size, env.rank, env.job_id) == ("slurm", 1, 0, "79")


def test_interactive_pty_shell_fails_fast() -> None:
    environ = slurm_step(
        SLURM_PTY_PORT="41234",
        SLURM_STEP_NUM_TASKS="1",
        SLURM_STEP_TASKS_PER_NODE="1",
        SLURM_STEP_NODELIST="gpu001",
        SLURMD_NODENAME="gpu001",
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
    )
    with pytest.raises(HpcDdpError) as caught:
        resolve_dist_env(environ, hostname="gpu001")
    assert "interactive `srun --pty` shell" in str(caught.value)
    assert "srun --overlap --ntasks=8" in str(caught.value)


def test_pty_step_uses_the_allocation_count_slurm_reports() -> None:
    """Inside `srun --pty` Slurm sets SLURM_NTASKS=1; scontrol's NumTasks tells the truth."""
    environ = {
        "SLURM_JOB_ID": "15",
        "SLURM_STEP_ID": "0",
        "SLURM_PTY_PORT": "46259",
        "SLURM_NTASKS": "1",
        "SLURM_STEP_NUM_TASKS": "1",
        "SLURM_STEP_TASKS_PER_NODE": "1",
        "SLURM_STEP_NODELIST": "node1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
    }
    assert needs_allocation_task_count(environ)
    assert resolve_dist_env(environ, hostname="node1").world_size == 1
    with pytest.raises(HpcDdpError, match="of 2 tasks: training would run on 1 rank"):
        resolve_dist_env(environ, hostname="node1", allocation_tasks=2)


def test_inconsistent_step_description_is_refused() -> None:
    with pytest.raises(HpcDdpError, match="does not add up"):
        resolve_dist_env(slurm_step(SLURM_STEP_NUM_TASKS="6"), hostname="h")


def torchrun_vars(**overrides: str) -> dict[str, str]:
    environ = {
        "TORCHELASTIC_RUN_ID": "rdzv-1",
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RESTART_COUNT": "1",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    environ.update(overrides)
    return environ


def test_torchrun_resolves_and_keeps_its_store() -> None:
    env = resolve_dist_env(torchrun_vars(), configured_port=31000, hostname="node2")
    assert (env.rank, env.local_rank, env.world_size, env.node_rank, env.num_nodes) == (
        3,
        1,
        4,
        1,
        2,
    )
    assert (env.master_addr, env.master_port) == ("node1", 29500), "torchrun's store is not moved"
    assert env.store_hosted_by_launcher
    assert (env.launcher, env.job_id, env.restart_count) == ("torchelastic", "rdzv-1", 1)


def test_the_jobs_elastic_restart_count_is_the_largest_any_agent_counted() -> None:
    """An agent whose workers did not fail restarts them without counting: its ranks take the
    count the others agree on (torchrun outside Slurm: it is also the attempt count)."""
    plain = torchrun_vars(TORCHELASTIC_RESTART_COUNT="0")
    env = resolve_dist_env(plain, configured_port=31000, hostname="node1")
    agreed = with_agreed_elastic_restarts(env, 2, plain)
    assert (agreed.elastic_restarts, agreed.restart_count) == (2, 2)
    in_slurm = {**plain, "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}
    env = resolve_dist_env(in_slurm, configured_port=31000, hostname="node1")
    agreed = with_agreed_elastic_restarts(env, 2, in_slurm)
    assert (agreed.elastic_restarts, agreed.restart_count) == (2, 1), "requeues stay Slurm's"
    assert with_agreed_elastic_restarts(agreed, 2, in_slurm) is agreed


def test_launcher_priority_is_pinned() -> None:
    """torchrun inside Slurm is torchrun; hpc-ddp local inside Slurm is local; else Slurm."""
    assert LAUNCHER_ORDER == ("torchelastic", "local", "slurm", "submitit-local", "single")
    everything = {**slurm_step(), **torchrun_vars(), "HPC_DDP_LOCAL_RUN_ID": "local-1"}
    assert detect_launcher(everything) == "torchelastic"
    del everything["TORCHELASTIC_RUN_ID"]
    assert detect_launcher(everything) == "local"
    del everything["HPC_DDP_LOCAL_RUN_ID"]
    assert detect_launcher(everything) == "slurm"
    assert detect_launcher({**everything, "SUBMITIT_LOCAL_JOB_ID": "9"}) == "slurm"
    assert detect_launcher({"SUBMITIT_LOCAL_JOB_ID": "9"}) == "submitit-local"
    assert detect_launcher({}) == "single"
    inside_slurm = resolve_dist_env({**slurm_step(), **torchrun_vars()}, hostname="h")
    assert inside_slurm.job_id == "4242", "torchrun under Slurm keeps the Slurm job id"


def test_single_process() -> None:
    env = resolve_dist_env({}, hostname="laptop", single_run_id="single-x")
    assert (env.rank, env.world_size, env.launcher, env.job_id, env.master_port) == (
        0,
        1,
        "single",
        "single-x",
        0,
    )
    assert env.is_main


def test_local_launcher_honours_configured_port() -> None:
    environ = {
        "HPC_DDP_LOCAL_RUN_ID": "local-1",
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "3",
        "LOCAL_WORLD_SIZE": "3",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "20001",
    }
    env = resolve_dist_env(environ, hostname="h")
    assert (env.launcher, env.rank, env.world_size, env.master_port) == ("local", 1, 3, 20001)
    assert resolve_dist_env(environ, configured_port=20500, hostname="h").master_port == 20500


def test_reading_never_writes_and_export_is_explicit() -> None:
    environ = slurm_step()
    before = dict(environ)
    os_before = dict(os.environ)
    env = resolve_dist_env(environ, hostname="gpu002")
    assert environ == before
    assert dict(os.environ) == os_before

    target = {"RANK": "99", "PATH": "/bin"}
    overwritten = export_dist_env(env, target)
    assert overwritten == {"RANK": "99"}
    assert (
        target["RANK"] == "5" and target["WORLD_SIZE"] == "8" and target["MASTER_ADDR"] == "gpu001"
    )
    assert target["PATH"] == "/bin"
    assert set(dist_env_variables(env)) <= set(target)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"LOCAL_WORLD_SIZE": "0"}, "local rank 1 of 0 on the node"),
        ({"RANK": "4"}, "rank 4 of world size 4"),
        ({"RANK": "-1"}, "rank -1 of world size 4"),
        ({"WORLD_SIZE": "0"}, "rank 3 of world size 0"),
        ({"MASTER_PORT": "99999"}, "port 99999"),
    ],
)
def test_launcher_variables_that_describe_no_job_are_refused(
    changes: dict[str, str], expected: str
) -> None:
    with pytest.raises(HpcDdpError) as caught:
        resolve_dist_env({**torchrun_vars(), **changes}, hostname="node2")
    message = str(caught.value)
    assert message.startswith("the torchelastic launcher's variables describe no valid job: ")
    assert expected in message and "HINT: check RANK, WORLD_SIZE" in message


@pytest.mark.e2e
def test_master_port_from_the_environment_is_range_checked_everywhere() -> None:
    import subprocess
    import sys

    from tests.helpers import REPO, clean_environ

    with pytest.raises(HpcDdpError, match="MASTER_PORT=99999 is not a TCP port"):
        port_override({"MASTER_PORT": "99999"}, None)
    under_torchrun = {**torchrun_vars(), "MASTER_PORT": "99999"}
    for command, environ in (
        (["port"], {"MASTER_PORT": "99999"}),
        (["doctor", "--config", "configs/digits.yaml"], under_torchrun),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "hpc_ddp", *command], cwd=REPO,
            env=clean_environ(**environ), capture_output=True, text=True, timeout=120,
            check=False,
        )  # fmt: skip
        assert result.returncode == 2, (command, result.stdout, result.stderr[-2000:])
        output = result.stdout + result.stderr  # doctor reports on stdout, as JSON
        assert "99999" in output and "HINT: " in output
        assert "Traceback" not in result.stderr
