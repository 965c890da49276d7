"""A user's own script (tests/programs/regression.py) on the real test Slurm cluster: sbatch
on 2 nodes x 2 tasks through a preemption, requeue and exact resume (its own DDP, and
FSDP2); the torchrun template; submitit running a callable on 2 nodes; and an
iteration-based LM loop (lm_loop.py) requeued by `scancel --signal=USR1`. (Two "nodes" are
two slurmd on this machine; a second physical host cannot exist here.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from hpc_ddp.launch.jobs import submit, wait
from hpc_ddp.runtime.monitor.account import PARTS
from hpc_ddp.runtime.tracking.base import default_tracking_uri
from tests.helpers import REPO, clean_environ, read_summary
from tests.programs import regression
from tests.slurm_cluster import SlurmCluster, prepare_workdir

pytestmark = pytest.mark.slurm
TRAIN = str(REPO / "slurm" / "train.sh")
TORCHRUN = str(REPO / "slurm" / "train-torchrun.sh")
PROGRAM = str(REPO / "tests" / "programs" / "regression.py")


PREEMPTED = [PROGRAM, "--epochs", "2", "--samples", "19200", "--log-interval", "5"]
SETTINGS = ["preempt.check_every_steps=1", "tracking.enabled=false"]


def sbatch_two_nodes(slurm: SlurmCluster, work: Path, *extra: str) -> str:
    """The script on 2 nodes x 2 tasks through slurm/train.sh, as a user submits it."""
    program = [*PREEMPTED, f"run.output_dir={work / 'runs'}", *SETTINGS, *extra]
    return slurm.sbatch(["--nodes=2", "--ntasks-per-node=2", TRAIN, *program], work)


#: (the preempted run's model, the uninterrupted run's): 4 ranks on 2 nodes, where a sum over
#: the ranks depends on its order. A DDP the script builds itself and registers gets
#: run.wrap's bucket layout, so it ends bitwise where run.wrap's uninterrupted run ends.
MODELS = {"own-ddp": (["--own-ddp"], []), "fsdp2": (["dist.strategy=fsdp"],) * 2}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_sbatch_two_nodes_preempted_requeues_and_resumes_to_the_same_weights(
    model: str, slurm: SlurmCluster, tmp_path: Path
) -> None:
    preempted_model, reference_model = MODELS[model]
    work = prepare_workdir(tmp_path / "preempted")
    job = sbatch_two_nodes(slurm, work, "--hold-at-step", "60", *preempted_model)
    log, stop_step = slurm.requeue_by_signal(
        job, work, work / f"hpc-ddp-{job}.out", r"HOLDING at step 60 \(rank 0\)"
    )
    assert stop_step == 61, "agreed at the check after scancel's signal reached every rank"
    assert f"at step {stop_step} (epoch 0, step {stop_step} of the epoch)" in log

    facts = read_summary(work / "runs", "regression")
    assert (facts["world_size"], facts["num_nodes"], facts["launcher"]) == (4, 2, "slurm")
    assert facts["restart_count"] == 1 and facts["resumed_from_step"] == stop_step
    assert facts["global_step"] == 400 and facts["job_id"] == job

    reference = prepare_workdir(tmp_path / "uninterrupted")
    assert slurm.wait(sbatch_two_nodes(slurm, reference, *reference_model), timeout=300) == (
        "COMPLETED"
    )
    expected = read_summary(reference / "runs", "regression")
    assert expected["restart_count"] == 0 and expected["resumed_from_step"] is None
    assert facts["weights_sha256"] == expected["weights_sha256"], "bitwise equal"
    assert facts["val_mse"] == expected["val_mse"]


def test_the_torchrun_template_runs_a_users_script(slurm: SlurmCluster, tmp_path: Path) -> None:
    work = prepare_workdir(tmp_path)
    job = slurm.sbatch(
        [
            "--nodes=2",
            TORCHRUN,
            PROGRAM,
            "--epochs",
            "1",
            f"run.output_dir={work / 'runs'}",
            "tracking.enabled=false",
        ],
        work,
    )
    state = slurm.wait(job, timeout=240)
    log = (work / f"hpc-ddp-torchrun-{job}.out").read_text()
    assert state == "COMPLETED", log[-4000:]
    facts = read_summary(work / "runs", "regression")
    assert (facts["world_size"], facts["num_nodes"], facts["launcher"]) == (4, 2, "torchelastic")
    assert '"val_count": 1001.0' in log, "rank 0's RESULT line"


def test_submitit_runs_a_callable_on_two_nodes_and_returns_every_rank(
    slurm: SlurmCluster, slurm_conf_in_environ: None, tmp_path: Path
) -> None:
    arguments = ["--epochs", "1", f"run.output_dir={tmp_path / 'runs'}", "tracking.enabled=false"]
    job = submit(
        regression.main,
        args=(arguments,),
        cluster="slurm",
        nodes=2,
        gpus_per_node=2,
        folder=tmp_path / "submitit",
        time="00:10:00",
    )
    results = wait(job)
    assert [result["world_size"] for result in results] == [4, 4, 4, 4]
    assert {result["num_nodes"] for result in results} == {2}
    assert {result["launcher"] for result in results} == {"slurm"}
    assert {result["job_id"] for result in results} == {str(job.job_id)}
    assert len({result["weights_sha256"] for result in results}) == 1
    assert {result["val_count"] for result in results} == {1001}


LM = str(REPO / "tests" / "programs" / "lm_loop.py")


def lm_job(slurm: SlurmCluster, work: Path, *extra: str) -> str:
    """The iteration-based LM loop on 2 nodes x 1 task through slurm/train.sh, tracked in
    MLflow (its own get_batch, dropout: the restored random streams carry both on)."""
    program = [LM, "--max-iters", "300", *extra, f"run.output_dir={work / 'runs'}"]
    return slurm.sbatch(
        ["--nodes=2", "--ntasks-per-node=1", TRAIN, *program, "preempt.check_every_steps=1"], work
    )


def test_an_iteration_based_loop_requeued_by_scancel_resumes_bitwise_in_one_mlflow_run(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    work = prepare_workdir(tmp_path / "preempted")
    job = lm_job(slurm, work, "--hold-at-step", "60")
    log, stop_step = slurm.requeue_by_signal(
        job, work, work / f"hpc-ddp-{job}.out", r"HOLDING at step 60 \(rank 0\)"
    )
    assert stop_step == 61, "agreed at the check after scancel's signal reached every rank"
    assert f"resuming the batches at step {stop_step}: run.iterations() draws nothing" in log
    resumed = json.loads(next((work / "runs").glob("lm_loop/*/summary.json")).read_text())
    assert resumed["restart_count"] == 1 and resumed["resumed_from_step"] == stop_step

    reference = prepare_workdir(tmp_path / "uninterrupted")
    assert slurm.wait(lm_job(slurm, reference), timeout=300) == "COMPLETED"
    expected = json.loads(next((reference / "runs").glob("lm_loop/*/summary.json")).read_text())
    assert resumed["global_step"] == expected["global_step"] == 300
    assert resumed["weights_sha256"] == expected["weights_sha256"], "bitwise equal"
    assert resumed["best_val_loss"] == expected["best_val_loss"]

    client = MlflowClient(tracking_uri=default_tracking_uri(work / "runs"))
    runs = client.search_runs([client.get_experiment_by_name("hpc_ddp").experiment_id])  # type: ignore[union-attr]
    assert [run.info.run_id for run in runs] == [resumed["mlflow_run_id"]], "one MLflow run"
    (run,) = runs
    assert run.info.status == "FINISHED" and run.data.tags["hpc_ddp.attempts"] == "2"
    assert run.data.tags["hpc_ddp.attempt.0.end"] == "requeued"
    evaluated = [point.step for point in client.get_metric_history(run.info.run_id, "val_loss")]
    assert evaluated == [0, 50, 100, 150, 200, 250], "each evaluation once across the requeue"


def test_a_rendered_job_submitted_from_elsewhere_runs_in_its_folder_and_writes_its_log(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """Outside a checkout there is no logs/ folder and Slurm does not create one: `hpc-ddp
    render` creates it and names it absolutely; the job works in the folder it was rendered
    in, so the program's relative paths (the script, its output) hold wherever it is
    submitted from."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    shutil.copy(LM, project / "train.py")
    rendered = subprocess.run(
        [sys.executable, "-m", "hpc_ddp", "render", "--nodes", "1", "--gpus-per-node", "0",
         "--tasks-per-node", "2", "-o", "job.sh", "train.py", "--max-iters", "20",
         "run.output_dir=runs", "tracking.enabled=false"],
        cwd=project, env=clean_environ(), capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    assert f"its log goes to {project / 'logs'}" in rendered.stderr
    script = (project / "job.sh").read_text()
    assert (
        "# Written by hpc-ddp from its train.sh template; it runs: train.py --max-iters 20"
        in script
    )
    job = slurm.sbatch([str(project / "job.sh")], elsewhere)
    state = slurm.wait(job, timeout=240)
    log = project / "logs" / f"hpc-ddp-{job}.out"
    assert log.is_file(), f"no log: {sorted(project.rglob('*'))}"
    assert state == "COMPLETED", log.read_text()[-3000:]
    assert '"global_step": 20' in log.read_text(), "rank 0's RESULT line"
    assert (project / "runs").is_dir(), "the run's record, beside the script it was rendered for"
    assert sorted(elsewhere.iterdir()) == [], "nothing written where sbatch was called"


VERSIONED = """
import hashlib, json, sys
import torch
import hpc_ddp

VERSION = 1
run = hpc_ddp.start(tracking={"enabled": False}, preempt={"stop_at_step": 10},
                    run={"output_dir": sys.argv[1], "id": "snapshot"})
model = run.wrap(torch.nn.Linear(2, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
run.register(model=model, optimizer=optimizer)
for _ in run.iterations(20):
    model(torch.ones(4, 2)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
if run.rank == 0:
    print(f"VERSION {VERSION} ended at step {run.global_step}", flush=True)
run.finish()
"""


def test_a_snapshot_job_runs_the_submitted_code_after_an_edit_and_through_a_requeue(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """render --snapshot, then the script is edited on disk: the job, requeued at step 10
    (preempt.stop_at_step, as a preemption), runs the submitted code in both attempts, and
    each attempt's record names the snapshot and the commit it was taken from."""
    from tests.test_user_script import commit_all

    project = tmp_path / "project"
    project.mkdir()
    script = project / "train.py"
    script.write_text(VERSIONED)
    commit = commit_all(project)
    rendered = subprocess.run(
        [sys.executable, "-m", "hpc_ddp", "render", "--snapshot", "--nodes", "1",
         "--gpus-per-node", "0", "--tasks-per-node", "2", "-o", "job.sh", "train.py",
         str(project / "runs")],
        cwd=project, env=clean_environ(), capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    script.write_text(VERSIONED.replace("VERSION = 1", "VERSION = 2"))  # edited after submission
    job = slurm.sbatch([str(project / "job.sh")], project)
    state = slurm.wait(job, timeout=300)
    log = (project / "logs" / f"hpc-ddp-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    assert slurm.job_field(job, "Restarts") == "1", log[-3000:]
    assert "0: VERSION 1 ended at step 20" in log and "VERSION 2" not in log, log[-3000:]
    assert "ran other code" not in log
    (copy,) = (project / "logs" / "snapshots").iterdir()
    attempts = json.loads((project / "runs" / "train" / "snapshot" / "provenance.json").read_text())
    assert [attempt["script"] for attempt in attempts] == [str(copy / "train.py")] * 2
    assert [attempt["git_commit"] for attempt in attempts] == [commit] * 2
    assert [attempt["snapshot"] for attempt in attempts] == [str(copy)] * 2


def stopped(pid: int) -> bool:
    """Whether process ``pid`` (of this machine: the test cluster's nodes share it) is
    stopped (state T, after SIGSTOP)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return fields[0] == "T"


def test_a_job_suspended_longer_than_its_stall_timeout_trains_on_when_resumed(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """`scontrol suspend` stops every task with SIGSTOP (as gang scheduling, or an
    administrator, does); resumed 20 s after both ranks stopped (twice the script's
    dist.stall_timeout_s, 10 s), the job trains on and completes: the time its processes did
    not run is not a stall, and each rank says so; rank 0 reads the job's end again, which
    Slurm moved by the suspension, and its time account has the suspension as a part of its
    own (not steps). Before, every rank's watchdog fired at the resume and the job failed,
    and the end was read again only after preempt.end_check_every_s (300 s)."""
    work = prepare_workdir(tmp_path)
    release = work / "release"
    program = str(REPO / "tests" / "programs" / "suspended.py")
    job = slurm.sbatch(["--nodes=2", "--ntasks-per-node=1", TRAIN, program, str(release)], work)
    log_path = work / f"hpc-ddp-{job}.out"
    pids = []
    for rank in (0, 1):
        text = slurm.wait_for_log(log_path, rf"TRAINING \(rank {rank}, pid \d+\)")
        pids.append(int(re.findall(rf"TRAINING \(rank {rank}, pid (\d+)\)", text)[0]))
    assert slurm.run(["scontrol", "suspend", job], work).returncode == 0
    deadline = time.monotonic() + 60
    while not all(map(stopped, pids)):  # slurmd stops the tasks after scontrol returns
        assert time.monotonic() < deadline, "the ranks were not stopped within 60 s"
        time.sleep(0.05)
    # How long the job stays suspended, not a wait for an event: longer changes nothing.
    time.sleep(20)
    assert slurm.run(["scontrol", "resume", job], work).returncode == 0
    # Slurm's end moves by the suspension (its run time leaves it out; squeue says whole
    # seconds, so about 20 s): read again at the first stop check, not 300 s later.
    slurm.wait_for_log(log_path, r"the job's end moved \+\d+ s")
    release.touch()
    state = slurm.wait(job, timeout=120)
    log = log_path.read_text()
    assert state == "COMPLETED", log[-3000:]
    for rank in (0, 1):
        said = rf"{rank}: .* rank {rank} did not run for \d+ s \(its process was stopped"
        assert re.search(said, log), log[-3000:]
    released = re.findall(r"RELEASED at step (\d+) \(rank (\d)\)", log)
    assert len(released) == 2 and released[0][0] == released[1][0], released
    assert "stalled" not in log, log[-3000:]
    [record] = list(work.rglob("attempts.json"))
    [attempt] = json.loads(record.read_text())
    account = attempt["account"]
    # Stopped for 20 s or more, which looks 0.5 s apart find all but one period of.
    assert account["suspended_s"] >= 19.0, account
    parts = sum(account[f"{part}_s"] for part in PARTS)
    assert parts == pytest.approx(account["allocation_s"], abs=0.01), account
    assert account["steps_s"] < account["allocation_s"] - account["suspended_s"]
