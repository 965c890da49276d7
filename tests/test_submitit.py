"""submitit: the local executor (no Slurm) and the real test cluster (1 and 2 nodes, cancel)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from hpc_ddp.cli.api import submit
from hpc_ddp.launch.jobs import CallTask, wait
from hpc_ddp.runtime.errors import HpcDdpError, Stopped
from hpc_ddp.runtime.place.env import resolve_dist_env
from hpc_ddp.runtime.place.slurm import derive_master_port
from hpc_ddp.trainer.config import load_config
from tests.helpers import REPO
from tests.slurm_cluster import SlurmCluster

CONFIG = REPO / "configs" / "synthetic.yaml"
SMALL = ["data.num_samples=2048", "data.batch_size=64", "train.epochs=1", "tracking.enabled=false"]


def test_local_executor_tasks_resolve_as_local_ranks() -> None:
    environ = {
        "SUBMITIT_LOCAL_JOB_ID": "4321",
        "SUBMITIT_LOCAL_NTASKS": "2",
        "SUBMITIT_LOCAL_GLOBALID": "1",
        "SUBMITIT_LOCAL_LOCALID": "1",
    }
    env = resolve_dist_env(environ, hostname="h")
    assert (env.launcher, env.rank, env.local_rank, env.world_size) == ("submitit-local", 1, 1, 2)
    assert (env.master_addr, env.job_id) == ("127.0.0.1", "submitit-4321")
    assert env.master_port == derive_master_port(4321)
    assert resolve_dist_env({**environ, "MASTER_PORT": "23456"}).master_port == 23456
    under_slurm = resolve_dist_env({**environ, "SLURM_JOB_ID": "5"}, hostname="h")
    assert under_slurm.launcher == "slurm", "a Slurm job wins over the local executor's ids"


def stops(checkpointed: bool) -> None:
    raise Stopped(7, requeued=False, run_id="r1", checkpointed=checkpointed)


@pytest.mark.parametrize("checkpointed", [True, False])
def test_a_task_stopped_and_not_requeued_says_whether_submitting_again_continues(
    checkpointed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the task names its program there
    monkeypatch.setenv("SLURM_PROCID", "1")
    with pytest.raises(RuntimeError) as raised:
        CallTask(stops, [checkpointed], {})()
    assert str(raised.value) == (
        "rank 1 stopped at step 7 after a checkpoint and the job was not requeued; submit "
        "again with run.id=r1 to continue"
        if checkpointed
        else "rank 1 stopped at step 7 without a checkpoint (checkpoint.enabled=false); a job "
        "submitted again starts from step 0"
    )


@pytest.mark.e2e
def test_local_executor_two_tasks_return_every_rank(tmp_path: Path) -> None:
    job = submit(
        CONFIG,
        cluster="local",
        tasks_per_node=2,
        folder=tmp_path / "submitit",
        overrides=[*SMALL, f"run.output_dir={tmp_path / 'runs'}"],
        time="10",
    )
    results = wait(job)
    assert len(results) == 2
    assert [r["world_size"] for r in results] == [2, 2]
    assert results[0]["summary_path"].startswith(str(tmp_path / "runs"))
    facts = ["global_step", "train_loss", "replicas_diverged_at", "torch_threads", "timeline"]
    assert results[0]["weights_sha256"] == results[1]["weights_sha256"], [
        {fact: result.get(fact) for fact in facts} for result in results
    ]
    assert [r["replicas_in_sync"] for r in results] == [True, True]
    threads = max(1, (os.cpu_count() or 1) // 2)
    assert [r["torch_threads"] for r in results] == [threads, threads], "tasks share the CPUs"
    assert results[0]["val_samples"] == 1001


@pytest.mark.e2e
def test_local_failure_names_the_rank_and_carries_its_traceback(tmp_path: Path) -> None:
    job = submit(
        CONFIG,
        cluster="local",
        tasks_per_node=2,
        folder=tmp_path / "submitit",
        overrides=[
            *SMALL,
            "model.kind=custom",
            "model.factory=tests.factories:failing_model",
            f"run.output_dir={tmp_path / 'runs'}",
            "dist.timeout_s=20",
        ],
        time="10",
    )
    with pytest.raises(HpcDdpError) as caught:
        wait(job)
    message = str(caught.value)
    assert f"job {job.job_id} failed on rank 1 (other failed ranks: 0)" in message
    assert "injected failure on rank 1" in message
    assert "Traceback" in message


def test_bad_config_fails_before_submission(tmp_path: Path) -> None:
    with pytest.raises(HpcDdpError, match=r"unknown key 'train\.epochz'"):
        submit(CONFIG, cluster="local", folder=tmp_path, overrides=["train.epochz=1"])
    with pytest.raises(HpcDdpError, match="needs Slurm"):
        submit(load_config(CONFIG), cluster="local", nodes=2, folder=tmp_path)


@pytest.mark.slurm
@pytest.mark.parametrize("nodes", [1, 2])
def test_slurm_returns_every_rank(
    slurm: SlurmCluster, slurm_conf_in_environ: None, tmp_path: Path, nodes: int
) -> None:
    job = submit(
        CONFIG,
        cluster="slurm",
        nodes=nodes,
        gpus_per_node=2,
        folder=tmp_path / "submitit",
        overrides=[*SMALL, f"run.output_dir={tmp_path / 'runs'}"],
        time="00:10:00",
    )
    results = wait(job)
    assert len(results) == 2 * nodes
    assert {r["world_size"] for r in results} == {2 * nodes}
    assert {r["launcher"] for r in results} == {"slurm"}
    assert {r["job_id"] for r in results} == {str(job.job_id)}
    assert {r["num_nodes"] for r in results} == {nodes}
    assert "summary_path" in results[0]
    # Results land before sacct records the end (a hang guard: it records it in seconds).
    deadline = time.monotonic() + 300
    while job.state != "COMPLETED" and time.monotonic() < deadline:
        time.sleep(1)
    assert job.state == "COMPLETED", "sacct did not record the job's end within 300 s"


@pytest.mark.slurm
def test_slurm_cancelled_job_is_reported_as_cancelled(
    slurm: SlurmCluster, slurm_conf_in_environ: None, tmp_path: Path
) -> None:
    job = submit(
        CONFIG,
        cluster="slurm",
        gpus_per_node=2,
        folder=tmp_path / "submitit",
        overrides=["train.epochs=100000", "tracking.enabled=false", f"run.output_dir={tmp_path}"],
        time="00:10:00",
    )
    deadline = time.monotonic() + 300  # a hang guard: it starts in seconds
    while job.state != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert job.state == "RUNNING", f"the job did not start within 300 s ({job.state})"
    job.cancel()
    with pytest.raises(HpcDdpError, match=f"job {job.job_id} ended CANCELLED"):
        wait(job)


@pytest.mark.e2e
def test_package_level_api_is_cheap_and_delegates(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = "import sys, hpc_ddp; print('torch' in sys.modules, 'submitit' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], "importing hpc_ddp loads neither"
    import hpc_ddp

    with pytest.raises(HpcDdpError, match="needs Slurm"):
        hpc_ddp.submit(CONFIG, cluster="local", nodes=2, folder=tmp_path)
