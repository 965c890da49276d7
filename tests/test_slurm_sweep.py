"""Sweeps on the real test Slurm cluster (3 nodes of 2 CPUs; "nodes" are slurmd daemons on
this machine: a second physical host cannot exist here).

A 6-task sweep of a user's script (tests/programs/regression.py, 2 ranks per task) with
concurrency 2: one task held at a step until it is preempted with ``scancel --signal=USR1
JOB_TASK`` (requeued alone, resumed bitwise equal to its uninterrupted twin), one task whose
learning rate makes the script fail, resumed with the setting fixed; every task runs the copy
of the code taken at submission (--snapshot); one MLflow parent with one child per task. And a
sweep larger than the cluster's MaxArraySize (8), submitted from Python as two arrays.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from tests.helpers import REPO, read_summary, run_local
from tests.slurm_cluster import SlurmCluster, prepare_workdir

pytestmark = pytest.mark.slurm
PROGRAM = str(REPO / "tests" / "programs" / "regression.py")
SWEEP = """\
name: lr
list:
  - {--lr: 0.05, --hold-at-step: 0}
  - {--lr: 0.05, --hold-at-step: 30}
  - {--lr: 0.1}
  - {--lr: 0.02}
  - {--lr: 40}
  - {--lr: 0.2}
concurrency: 2
metric: val_mse
"""


def hpc_ddp(slurm: SlurmCluster, work: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return slurm.run([sys.executable, "-m", "hpc_ddp", *args], work, timeout=120)


class RunningCount:
    """The most tasks of one array running at once, read from squeue every 0.3 s."""

    def __init__(self, slurm: SlurmCluster, work: Path, array: str) -> None:
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(slurm, work, array))
        self._thread.start()

    def _watch(self, slurm: SlurmCluster, work: Path, array: str) -> None:
        while not self._stop.is_set():
            listed = slurm.run(["squeue", "-h", "-r", "-j", array, "-t", "R", "-o", "%i"], work)
            self.most = max(self.most, len(listed.stdout.split()))
            time.sleep(0.3)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.most


def record(sweep_dir: Path) -> dict[str, Any]:
    """The sweep's record as hpc_ddp reads it: sweep.json and what its tasks wrote beside."""
    from hpc_ddp.sweep.manifest import read_manifest

    return read_manifest(sweep_dir)


def wait_for_sweep(sweep_dir: Path, timeout: float = 300) -> dict[str, Any]:
    """The record once no task is pending, running or requeued."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        data = record(sweep_dir)
        if all(task["state"] in ("finished", "failed", "stopped") for task in data["tasks"]):
            return data
        time.sleep(1)
    pytest.fail(f"the sweep did not end within {timeout:.0f} s: {record(sweep_dir)['tasks']}")


def summary(sweep_dir: Path, task: int) -> dict[str, Any]:
    """Task ``task``'s summary: each task is a run of its own, <sweep dir>/task-NNN."""
    return read_summary(sweep_dir.parent, sweep_dir.name, f"task-{task:03d}")


def test_a_sweep_runs_two_at_a_time_survives_a_preemption_and_resumes_its_failed_task(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    work = prepare_workdir(tmp_path)
    (work / "sweep.yaml").write_text(SWEEP)
    submitted = hpc_ddp(
        slurm,
        work,
        "sweep",
        "submit",
        "sweep.yaml",
        "--snapshot",
        "--nodes=1",
        "--tasks-per-node=2",
        "--cpus-per-task=1",
        "--time=00:10:00",
        "--",
        PROGRAM,
        "--epochs=2",
        "--samples=9600",
        "--log-interval=5",
        "preempt.check_every_steps=1",
    )
    assert submitted.returncode == 0, submitted.stderr
    sweep_dir = work / "runs" / "lr"
    array = record(sweep_dir)["arrays"][0]["job_id"]
    assert f"submitted job array {array} (--array=0-5%2): tasks 0-5" in submitted.stdout
    running = RunningCount(slurm, work, array)
    try:
        # A sweep still running is not resumed: its tasks are named. Task 1 (a twin of task
        # 0) holds after step 30 until it is signalled: it is one of them, however fast the
        # other tasks end.
        refused = hpc_ddp(slurm, work, "sweep", "resume", str(sweep_dir))
        assert refused.returncode == 2, refused.stderr
        assert re.search(rf"is still running: tasks (.*, )?1 \({array}_1 ", refused.stderr)
        # Task 1 is preempted while it holds, alone.
        slurm.wait_for_log(
            sweep_dir / "logs" / f"lr-{array}_1.out", r"HOLDING at step 30 \(rank 0\)"
        )
        signalled = slurm.run(["scancel", "--signal=USR1", f"{array}_1"], work)
        assert signalled.returncode == 0, signalled.stderr
        data = wait_for_sweep(sweep_dir)
    finally:
        most = running.stop()
    assert most == 2, "3 nodes fit 3 tasks: %2 holds them to 2"
    assert [task["state"] for task in data["tasks"]] == ["finished"] * 4 + ["failed", "finished"]
    # Slurm 22.05's scancel retries a signal to an array task that its requeue made "not
    # alterable now", and the retry may stop the task's next attempt once more.
    attempts = [task["attempts"] for task in data["tasks"]]
    assert attempts[:1] + attempts[2:] == [1] * 5 and attempts[1] in (2, 3), attempts
    log = (sweep_dir / "logs" / f"lr-{array}_1.out").read_text()
    assert f"requeued job {array}_1" in log
    # The job script's first line and rank 0's name the task as squeue does, with its id.
    assert re.search(rf"^job {array}_1 \(id \d+\) on ", log, re.M), log[:2000]
    assert re.search(rf"INFO job {array}_1 \(id \d+\) \(slurm\): 2 rank\(s\)", log), log[:2000]
    preempted, twin = summary(sweep_dir, 1), summary(sweep_dir, 0)
    assert preempted["restart_count"] == attempts[1] - 1
    assert 30 < preempted["resumed_from_step"] < 200
    assert preempted["weights_sha256"] == twin["weights_sha256"], "bitwise equal to its twin"
    assert twin["restart_count"] == 0

    status = hpc_ddp(slurm, work, "sweep", "status", str(sweep_dir))
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert "1 failed, 5 finished" in lines
    assert lines[2].split()[:2] == ["5", "finished"], "lr=0.2 ends lowest: best first"
    # srun's code is the first rank's to end: 1 (it raised), or 143 / 137 (srun ended it with
    # SIGTERM or SIGKILL when the other rank raised first)
    assert re.search(
        rf"task 4: exit code (1|137|143): see {sweep_dir}/logs/lr-{array}_4\.out", status.stdout
    )
    assert "FloatingPointError: loss" in (sweep_dir / "logs" / f"lr-{array}_4.out").read_text()

    resumed = hpc_ddp(slurm, work, "sweep", "resume", str(sweep_dir), "--set", "lr=0.05")
    assert resumed.returncode == 0, resumed.stderr
    assert "resubmitting 1 of 6 tasks: 4" in resumed.stdout
    data = wait_for_sweep(sweep_dir)
    assert [task["state"] for task in data["tasks"]] == ["finished"] * 6
    assert data["tasks"][4]["settings"] == {"--lr": "0.05"}
    assert len(data["arrays"]) == 2 and data["arrays"][1]["tasks"] == [4]
    # The job script ends with the task's own status (a set -u trap once turned it into 1).
    assert slurm.wait(str(data["arrays"][1]["job_id"]), timeout=60) == "COMPLETED"
    assert summary(sweep_dir, 4)["weights_sha256"] == twin["weights_sha256"]
    # --snapshot: every task, its requeues and the resubmitted one ran the copy taken at
    # submission (of this checkout), which the record names.
    (copy,) = (sweep_dir / "snapshots").iterdir()
    snapshot_program = str(copy / "tests" / "programs" / "regression.py")
    assert data["program"]["name"] == snapshot_program
    for task in range(6):
        ran = json.loads((sweep_dir / f"task-{task:03d}" / "provenance.json").read_text())
        assert {attempt["script"] for attempt in ran} == {snapshot_program}, task
        assert {attempt["snapshot"] for attempt in ran} == {str(copy)}, task
        # Each attempt names its job as squeue does: <array id>_<task id>.
        assert all(re.fullmatch(r"\d+_\d+", attempt["job"]) for attempt in ran), ran
    assert "6 finished" in hpc_ddp(slurm, work, "sweep", "status", str(sweep_dir)).stdout

    client = MlflowClient(f"sqlite:///{work / 'runs' / 'mlflow.db'}")
    parent_id = data["tracking"]["parent_run_id"]
    deadline = time.monotonic() + 60  # the job script ends it just after recording the task
    while client.get_run(parent_id).info.status == "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.5)
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and parent.data.params["sweep.tasks"] == "6"
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    by_task = {int(run.data.tags["hpc_ddp.sweep.task"]): run for run in children}
    assert sorted(by_task) == list(range(6)) and len(children) == 6, "one child per task"
    assert {task: run.data.params["sweep.lr"] for task, run in by_task.items()} == {
        0: "0.05",
        1: "0.05",
        2: "0.1",
        3: "0.02",
        4: "40",
        5: "0.2",
    }
    assert by_task[1].data.tags["hpc_ddp.attempts"] == str(attempts[1])
    assert by_task[4].data.tags["hpc_ddp.sweep.overrides"] == "--lr=0.05"
    assert {run.info.status for run in children} == {"FINISHED"}
    assert {task["mlflow_run_id"] for task in data["tasks"]} == {
        run.info.run_id for run in children
    }

    plotted = hpc_ddp(slurm, work, "sweep", "plot", str(sweep_dir))
    assert plotted.returncode == 0, plotted.stderr
    assert (sweep_dir / "val_mse.png").stat().st_size > 10_000


TINY = """\
import sys
print("TASK", sys.argv[1:])
"""


def test_a_sweep_larger_than_max_array_size_is_split_into_arrays_run_one_after_another(
    slurm: SlurmCluster,
    slurm_conf_in_environ: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Submitted from Python; the program is a plain script (no hpc_ddp run of its own)."""
    import hpc_ddp

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", slurm.environ()["PATH"])  # the jobs' python: this one's
    (tmp_path / "tiny.py").write_text(TINY)
    sweep = hpc_ddp.submit_sweep(
        "tiny.py --fixed 1",
        name="big",
        grid={"--value": list(range(10))},
        concurrency=3,
        tasks_per_node=1,
        time="00:05:00",
        output_dir=tmp_path / "runs",
    )
    rows = sweep.wait(poll_s=1, timeout_s=180)
    assert sorted(row.state for row in rows) == ["finished"] * 10
    data = record(sweep.directory)
    first, second = data["arrays"]
    assert (first["offset"], first["tasks"]) == (0, list(range(8)))
    assert (second["offset"], second["tasks"]) == (8, [8, 9])
    for task in range(10):
        array = first if task < 8 else second
        job = f"{array['job_id']}_{task - array['offset']}"
        log = (sweep.directory / "logs" / f"big-{job}.out").read_text()
        assert f"TASK ['--fixed', '1', '--value', '{task}']" in log
        assert f"sweep big task {task} (job {job}): value={task}" in log

    def times(array: dict[str, Any]) -> list[tuple[str, str]]:
        """(start, end) of each task of ``array``, as slurmctld keeps them."""
        shown = slurm.run(["scontrol", "show", "job", "-o", array["job_id"]], tmp_path).stdout
        return re.findall(r"StartTime=(\S+) EndTime=(\S+)", shown)

    ends = [end for _start, end in times(first)]
    starts = [start for start, _end in times(second)]
    assert len(ends) == 8 and len(starts) == 2
    assert min(starts) >= max(ends), "the second array starts after the first ended"


USER_SWEEP = '''\
"""A user's sweep of a function, as submitit's map_array runs one: `python sweep_fn.py`."""
import json

import torch
from torch import nn

import hpc_ddp


def train(lr: float, width: int = 8, steps: int = 20) -> dict:
    run = hpc_ddp.start()
    torch.manual_seed(0)
    model = run.wrap(nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    run.register(model=model, optimizer=optimizer)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    for step in run.iterations(steps):
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss {loss.item()} at step {step}")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        run.log("mse", loss.detach())
    run.finish({"final_mse": float(loss)})
    return {"lr": lr, "lr_type": type(lr).__name__, "width": width, "steps": steps,
            "seed": run.config.run.seed, "ranks": run.world_size, "mse": float(loss)}


if __name__ == "__main__":
    sweep = hpc_ddp.submit_sweep(
        train,
        name="fn",
        kwargs={"steps": 30},
        tasks=[{"lr": 0.05}, {"lr": 1e-05, "width": 16, "run.seed": 7}, {"lr": 1000}],
        concurrency=3,
        tasks_per_node=2,
        time="00:05:00",
    )
    rows = sweep.wait(poll_s=1, timeout_s=240)
    print("STATES", json.dumps([row.state for row in rows]))
    print("RESULTS", json.dumps(sweep.results()))
'''


def test_a_sweep_of_a_python_function_calls_it_per_task_and_keeps_what_it_returned(
    slurm: SlurmCluster,
    slurm_conf_in_environ: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """submitit-style: a function of the user's own script (pickled by value), 2 ranks per
    task, typed keyword arguments, a dotted setting, a task that fails in the user's code and
    is resumed from the command line with its argument fixed."""
    import hpc_ddp as toolkit

    (tmp_path / "sweep_fn.py").write_text(USER_SWEEP)
    submitted = slurm.run([sys.executable, "sweep_fn.py"], tmp_path, timeout=300)
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    states = json.loads(re.search(r"^STATES (.*)$", submitted.stdout, re.M)[1])  # type: ignore[index]
    results = json.loads(re.search(r"^RESULTS (.*)$", submitted.stdout, re.M)[1])  # type: ignore[index]
    assert states == ["finished", "finished", "failed"]
    assert results[0] == {"lr": 0.05, "lr_type": "float", "width": 8, "steps": 30,
                          "seed": 0, "ranks": 2, "mse": results[0]["mse"]}  # fmt: skip
    assert results[1]["lr"] == 1e-05 and results[1]["width"] == 16 and results[1]["seed"] == 7
    assert results[0]["mse"] < results[1]["mse"], "lr 0.05 learns; 1e-05 barely moves"
    assert results[2] is None, "a failed task returned nothing"
    sweep_dir = tmp_path / "runs" / "fn"
    data = record(sweep_dir)
    assert data["program"]["kind"] == "callable" and data["program"]["name"] == "__main__.train"
    log = next((sweep_dir / "logs").glob("fn-*_2.out")).read_text()
    # The user's frames, not the toolkit's: the failure shows where in their function it was.
    raised = (
        USER_SWEEP.splitlines().index(
            '            raise FloatingPointError(f"loss {loss.item()} at step {step}")'
        )
        + 1
    )
    assert f'sweep_fn.py", line {raised}, in train' in log and "FloatingPointError: loss" in log
    assert "hpc_ddp/sweep" not in log

    resumed = hpc_ddp(slurm, tmp_path, "sweep", "resume", str(sweep_dir), "--set", "lr=0.05")
    assert resumed.returncode == 0, resumed.stderr
    assert "resubmitting 1 of 3 tasks: 2" in resumed.stdout
    monkeypatch.setenv("PATH", slurm.environ()["PATH"])
    rows = toolkit.Sweep(sweep_dir).wait(poll_s=1, timeout_s=180)
    assert [row.state for row in rows] == ["finished"] * 3
    again = toolkit.Sweep(sweep_dir).results()
    assert again[2] == {**results[0], "mse": again[2]["mse"]}
    assert again[2]["mse"] == results[0]["mse"], "the same function and arguments as task 0"


def test_a_sweep_task_that_loses_a_rank_leaves_its_node_out_and_resumes(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """A one-task sweep of the built-in trainer on 2 nodes: rank 1 is killed (SIGKILL, as by a
    failing host) at step 12 of the first attempt. The array task's script leaves that node
    out of the task's job and requeues it, as slurm/train.sh does; the task is not recorded
    as ended then, and its next attempt, on the other two nodes, resumes from step 8 and
    ends with the weights of a run never killed."""
    work = prepare_workdir(tmp_path)
    (work / "sweep.yaml").write_text("name: lost\nlist:\n  - {run.seed: 0}\n")
    settings = ["model.kind=custom", "model.factory=tests.factories:killed_model",
                "checkpoint.every_steps=8", "checkpoint.save_mode=single_file",
                "tracking.enabled=false", "data.num_samples=3072", "data.batch_size=96",
                "train.epochs=2", "train.log_interval=4"]  # fmt: skip
    submitted = hpc_ddp(
        slurm, work, "sweep", "submit", "sweep.yaml", "--nodes=2", "--tasks-per-node=1",
        "--cpus-per-task=1", "--time=00:10:00", "--", "--config", "configs/synthetic.yaml",
        *settings,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    sweep_dir = work / "runs" / "lost"
    data = wait_for_sweep(sweep_dir)
    array = data["arrays"][0]["job_id"]
    log = (sweep_dir / "logs" / f"lost-{array}_0.out").read_text()
    assert [(task["state"], task["attempts"]) for task in data["tasks"]] == [("finished", 2)], log
    killed = re.search(r"srun: error: (\S+): task 1: Killed", log)
    left_out = re.search(r"hpc-ddp: task 1 on (\S+) was killed by SIGKILL: left \1 out of job "
                         r"(\S+) \(ExcNodeList: \1\)", log)  # fmt: skip
    assert killed and left_out and left_out.group(1) == killed.group(1), log[-3000:]
    node, job = left_out.groups()
    assert job == f"{array}_0", "the array's task, as Slurm names it"
    assert slurm.job_field(job, "ExcNodeList") == node and slurm.job_field(job, "Restarts") == "1"
    ran_on = slurm.run(["scontrol", "show", "hostnames", slurm.job_field(job, "NodeList")], work)
    assert node not in ran_on.stdout.split() and len(ran_on.stdout.split()) == 2
    failures = json.loads((sweep_dir / "task-000" / "excluded_hosts.json").read_text())
    assert [(f["hosts"], f["event"], f["requeued"]) for f in failures] == [
        ([node], "lost a rank", True)
    ]
    task = summary(sweep_dir, 0)
    assert (task["restart_count"], task["resumed_from_step"]) == (1, 8)
    reference = run_local(2, work / "reference", [*settings, "run.seed=0"])
    assert reference.returncode == 0, reference.stderr[-2000:]
    assert task["weights_sha256"] == read_summary(work / "reference")["weights_sha256"]
