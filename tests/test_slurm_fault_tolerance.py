"""Fault tolerance on the real test Slurm cluster: preemption -> requeue -> exact resume in one
MLflow run, the time-limit signal, kill -9 of a rank, a kill during a checkpoint write, and
submitit preemption. (Two "nodes" are two slurmd on this machine; see test_slurm_e2e.py.)"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from hpc_ddp.cli.api import submit
from hpc_ddp.launch.jobs import wait
from hpc_ddp.runtime.checkpoint.files import list_checkpoints, load_checkpoint
from hpc_ddp.runtime.checkpoint.sharded.layout import is_complete
from hpc_ddp.runtime.monitor.account import PARTS
from hpc_ddp.runtime.tracking.base import default_tracking_uri
from tests.helpers import REPO, clean_environ, read_summary, run_local, summary_path
from tests.slurm_cluster import SlurmCluster, prepare_workdir

pytestmark = pytest.mark.slurm
TRAIN = str(REPO / "slurm" / "train.sh")
LONG = [
    "data.num_samples=25600",
    "data.batch_size=64",
    "train.epochs=1",
    "train.log_interval=8",
    "optim.schedule=cosine",
    "optim.warmup_steps=10",
    "preempt.check_every_steps=1",
]
#: LONG's model, holding at step 60 of a job's first attempt until the warning signal came.
HELD = ["model.kind=custom", "model.factory=tests.factories:held_until_a_warning_signal"]
#: LONG's model, holding at step 60 of a job's first attempt until run.output_dir/release
#: exists.
RELEASED = ["model.kind=custom", "model.factory=tests.factories:held_until_released"]
#: Where a stop lands when the warning signal comes at the hold (the stop agreement's step).
HELD_STOP_STEP = 62
SMALL = ["data.num_samples=3072", "data.batch_size=96", "train.epochs=2", "train.log_interval=4"]


def rank_pid(job_id: str, rank: int, timeout: float = 60) -> int:
    """PID of the training task of ``job_id`` (tasks share this machine's PID space) whose
    SLURM_PROCID is ``rank``: a python process (srun's own command line names the program
    too, and the batch step's environment has SLURM_PROCID=0)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if (
                Path(cmdline.split(b"\0")[0].decode(errors="replace")).name.startswith("python")
                and b"hpc_ddp.train" in cmdline
                and f"SLURM_JOB_ID={job_id}".encode() in environ
                and f"SLURM_PROCID={rank}".encode() in environ
            ):
                return int(entry.name)
        time.sleep(0.2)
    pytest.fail(f"no process of rank {rank} of job {job_id}")


#: weights_sha256 of each uninterrupted reference trained so far, by its training settings:
#: tests of the same training compare with one reference run.
_REFERENCES: dict[tuple[int, frozenset[str]], str] = {}


def uninterrupted_weights(tmp_path: Path, overrides: list[str], nproc: int = 2) -> str:
    """weights_sha256 of the same training on ``nproc`` local ranks, never interrupted."""
    key = (nproc, frozenset(overrides) - {"tracking.enabled=false"})
    if key not in _REFERENCES:
        reference_dir = tmp_path / "reference"
        reference = run_local(nproc, reference_dir, [*overrides, "tracking.enabled=false"])
        assert reference.returncode == 0, reference.stderr[-2000:]
        _REFERENCES[key] = str(read_summary(reference_dir)["weights_sha256"])
    return _REFERENCES[key]


def the_mlflow_run(work: Path, job: str) -> Any:
    """The one MLflow run every attempt of ``job`` logged into."""
    client = MlflowClient(tracking_uri=default_tracking_uri(work / "runs"))
    runs = client.search_runs(["1"], filter_string=f"tags.`hpc_ddp.job_id` = '{job}'")
    assert len(runs) == 1, "every attempt logs into ONE run"
    return runs[0]


def preempt_and_wait(
    slurm: SlurmCluster,
    work: Path,
    script: list[str],
    log_name: str,
    overrides: list[str],
    warning_signal: str = "USR1",
) -> tuple[str, str, int]:
    """Submit LONG training (``script``: sbatch options, then the script) of the HELD model,
    send the warning signal as preemption does once the ranks hold at step 60, and wait for
    the requeued job to end COMPLETED; returns its id, its log and the step it stopped at."""
    job = slurm.sbatch(
        [
            "--nodes=1",
            *script,
            "configs/synthetic.yaml",
            f"run.output_dir={work / 'runs'}",
            *overrides,
            *HELD,
            *LONG,
        ],
        work,
    )
    log_path = work / f"{log_name}-{job}.out"
    # Every rank: one still before its step-60 stop check would take the signal there.
    for rank in (0, 1):
        slurm.wait_for_log(log_path, rf"HOLDING at step 60 \(rank {rank}\)")
    assert slurm.run(["scancel", f"--signal={warning_signal}", job], work).returncode == 0
    state = slurm.wait(job, timeout=300)
    log = log_path.read_text()
    assert state == "COMPLETED", log[-4000:]
    assert f"requeued job {job}" in log
    handoffs = Path(os.environ.get("TMPDIR", "/tmp")).glob(f"hpc-ddp-step-{job}-*")
    assert not list(handoffs), "the batch script of each attempt removes its hand-off file"
    stop_step = int(re.search(r"checkpoint \(stop signal\) step (\d+)", log).group(1))  # type: ignore[union-attr]
    assert stop_step == HELD_STOP_STEP, log[-4000:]
    return job, log, stop_step


def attempts_of(runs: Path) -> list[dict[str, Any]]:
    """The one run's attempts.json under ``runs``, each entry checked: its parts add up to
    its allocation."""
    [record] = list(runs.rglob("attempts.json"))
    attempts: list[dict[str, Any]] = json.loads(record.read_text())
    for attempt in attempts:
        account = attempt["account"]
        parts = sum(account[f"{part}_s"] for part in PARTS)
        assert parts == pytest.approx(account["allocation_s"], abs=0.01), attempt
    return attempts


def torchrun_job_losing_a_rank(
    slurm: SlurmCluster, work: Path, options: list[str], overrides: list[str]
) -> tuple[str, dict[str, Any]]:
    """Submit the torchrun template (sbatch ``options``) for one epoch of LONG training that
    checkpoints every 20 steps, of a model (in ``overrides``) whose worker of one RANK
    SIGKILLs itself in the first round once the first checkpoint is whole, and wait for the
    job: it must COMPLETE after one restart by torchrun, resumed from a checkpoint. Returns
    the job's id and its summary."""
    job = slurm.sbatch(
        [*options, str(REPO / "slurm" / "train-torchrun.sh"), "configs/synthetic.yaml",
         f"run.output_dir={work / 'runs'}", *overrides],
        work,
    )  # fmt: skip
    state = slurm.wait(job, timeout=300)
    log = (work / f"hpc-ddp-torchrun-{job}.out").read_text()
    assert state == "COMPLETED", log[-4000:]
    assert "torchrun restarted the workers (1 time(s)" in log, log[-4000:]
    summary = read_summary(work / "runs")
    assert summary["resumed_from_step"] == 20, "the rank is lost at step 30, after step 20's"
    assert summary["global_step"] == 400
    return job, summary


def test_preemption_requeues_resumes_exactly_in_one_mlflow_run(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    work = prepare_workdir(tmp_path / "slurm")
    job, log, stop_step = preempt_and_wait(
        slurm, work, ["--ntasks-per-node=2", TRAIN], "hpc-ddp", []
    )
    assert slurm.job_field(job, "Restarts") == "1"
    epoch, within = divmod(stop_step, 400)
    assert f"at step {stop_step} (epoch {epoch}, step {within} of the epoch)" in log

    summary = read_summary(work / "runs")
    assert summary["restart_count"] == 1 and summary["resumed_from_step"] == stop_step
    assert summary["global_step"] == 400

    assert summary["weights_sha256"] == uninterrupted_weights(tmp_path, [*HELD, *LONG])
    run = the_mlflow_run(work, job)
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert (
        tags["hpc_ddp.attempts"],
        tags["hpc_ddp.attempt.0.end"],
        tags["hpc_ddp.attempt.1.end"],
    ) == ("2", "requeued", "finished")
    assert (tags["hpc_ddp.attempt.0.restart_count"], tags["hpc_ddp.attempt.1.restart_count"]) == (
        "0",
        "1",
    )
    client = MlflowClient(tracking_uri=default_tracking_uri(work / "runs"))
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "interval/train_loss")]
    assert steps == list(range(8, 401, 8)), "0 steps lost or repeated"

    stopped, requeued = attempts_of(work / "runs")
    assert (stopped["status"], stopped["last_step"]) == ("stopped", stop_step)
    assert (requeued["status"], requeued["from_step"]) == ("finished", stop_step)
    assert requeued["redone_steps"] == 0, "a stop with a checkpoint loses no step"
    total = summary["time_account"]
    assert (total["attempts"], total["attempts_unaccounted"]) == (2, 0)
    queued = requeued["start_unix"] - stopped["end_unix"]
    assert total["queued_s"] == pytest.approx(queued, abs=1e-3) and queued > 0


def test_a_job_preempted_then_losing_a_rank_accounts_for_its_three_attempts(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """Preempted (USR1 while the ranks hold at step 60), requeued, then rank 1 of the second
    attempt killed outright (SIGKILL) after that attempt's first checkpoint, left out with
    its node and requeued: the run's record has three attempts, each one charged from
    Slurm's start of it and its parts adding up to its allocation, the steps the killed
    attempt took past its checkpoint charged to the third as redone, and the time the job
    waited in the queue between them."""
    work = prepare_workdir(tmp_path / "slurm")
    factory = ["model.kind=custom", "model.factory=tests.factories:held_then_rank1_killed"]
    job = slurm.sbatch(
        ["--nodes=1", "--ntasks-per-node=2", TRAIN, "configs/synthetic.yaml",
         f"run.output_dir={work / 'runs'}", "tracking.enabled=false",
         "checkpoint.every_steps=20", *LONG, *factory],
        work,
    )  # fmt: skip
    log_path = work / f"hpc-ddp-{job}.out"
    for rank in (0, 1):
        slurm.wait_for_log(log_path, rf"HOLDING at step 60 \(rank {rank}\)")
    assert slurm.run(["scancel", "--signal=USR1", job], work).returncode == 0
    state = slurm.wait(job, timeout=300)
    log = log_path.read_text()
    assert state == "COMPLETED", log[-4000:]
    assert slurm.job_field(job, "Restarts") == "2", log[-4000:]
    assert re.search(r"srun: error: \S+: task 1: Killed", log), log[-4000:]

    stopped, killed, finished = attempts_of(work / "runs")  # each: parts == allocation
    assert (stopped["status"], stopped["last_step"]) == ("stopped", HELD_STOP_STEP)
    assert killed["from_step"] == HELD_STOP_STEP and killed["status"] != "finished", killed
    assert finished["status"] == "finished" and finished["from_step"] > HELD_STOP_STEP
    # What the killed attempt did past the checkpoint the third resumed from is lost work.
    assert finished["redone_steps"] == max(0, killed["last_step"] - finished["from_step"])
    # The batch script before srun holds the allocation too (Slurm 22.05 here: from squeue).
    slurm_starts = sorted(slurm.job_starts(job, 3))
    assert [attempt["start_unix"] for attempt in (stopped, killed, finished)] == slurm_starts
    gaps = [later["start_unix"] - earlier["end_unix"]
            for earlier, later in ((stopped, killed), (killed, finished))]  # fmt: skip
    assert all(gap > 0 for gap in gaps), gaps
    summary = read_summary(work / "runs")
    assert summary["global_step"] == 400 and summary["resumed_from_step"] == finished["from_step"]
    total = summary["time_account"]
    assert (total["attempts"], total["attempts_unaccounted"]) == (3, 0)
    assert total["queued_s"] == pytest.approx(sum(gaps), abs=1e-3)
    assert total["redone_s"] > 0 or finished["redone_steps"] == 0


def minutes_from_now(run_time: str, minutes: int) -> int:
    """A time limit (whole minutes) ``minutes`` beyond a job's RunTime ("[D-]HH:MM:SS")."""
    days, _, clock = run_time.rpartition("-")
    hours, mins, secs = (int(part) for part in clock.split(":"))
    elapsed = ((int(days or 0) * 24 + hours) * 60 + mins) * 60 + secs
    return -(-elapsed // 60) + minutes


def test_a_job_with_no_warning_signal_stops_before_a_limit_shortened_while_it_runs(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """A job script with no --signal: rank 0 reads the job's end (squeue); `scontrol update
    TimeLimit` brings it within preempt.end_margin_s while the job trains; the ranks stop
    with a checkpoint and requeue, and the job (its limit raised again) ends with the
    weights of an uninterrupted run."""
    work = prepare_workdir(tmp_path / "slurm")
    lines = Path(TRAIN).read_text().splitlines()
    (work / "no-signal.sh").write_text(
        "\n".join(line for line in lines if not line.startswith("#SBATCH --signal")) + "\n"
    )
    end = ["preempt.end_margin_s=200", "preempt.end_check_every_s=1", "preempt.max_requeues=10"]
    runs = work / "runs"
    job = slurm.sbatch(
        ["--nodes=1", "--time=10", str(work / "no-signal.sh"), "configs/synthetic.yaml",
         f"run.output_dir={runs}", "tracking.enabled=false", *end, *RELEASED, *LONG],
        work,
    )  # fmt: skip
    log_path = work / f"hpc-ddp-{job}.out"
    log = slurm.wait_for_log(log_path, r"HOLDING at step 60 \(rank 0\)")
    assert re.search(r"the job ends at \S+ \(in \d+ s\): the ranks stop with a checkpoint", log)
    # 60 to 180 s from now: within the 200 s margin (+ the save and checks), so it stops.
    short = minutes_from_now(slurm.job_field(job, "RunTime"), 2)
    update = ["scontrol", "update", f"JobId={job}"]
    before_update = len(log_path.read_text())
    assert slurm.run([*update, f"TimeLimit={short}"], work).returncode == 0
    # The ranks hold until rank 0's reading of the job's end has seen the new limit.
    slurm.wait_for_log(log_path, r"the job's end moved -\d+ s", since=before_update)
    (runs / "release").touch()
    slurm.wait_for_log(log_path, f"requeued job {job}", timeout=120)
    # A requeued attempt would stop at once under the short limit: give it the long one.
    assert slurm.run([*update, "TimeLimit=10"], work).returncode == 0
    state = slurm.wait(job, timeout=300)
    log = log_path.read_text()
    assert state == "COMPLETED", log[-4000:]
    assert "the job's end moved" in log and "stopping before the job's time limit" in log
    assert "SIGUSR1" not in log and "signal 10" not in log, "no warning signal came"
    first_stop = int(re.search(r"checkpoint \(stop signal\) step (\d+)", log).group(1))  # type: ignore[union-attr]
    assert first_stop == HELD_STOP_STEP, log[-4000:]
    summary = read_summary(work / "runs")
    assert summary["restart_count"] >= 1 and summary["global_step"] == 400
    assert summary["weights_sha256"] == uninterrupted_weights(tmp_path, [*RELEASED, *LONG])


def test_a_script_rendered_for_usr2_stops_on_usr2_and_requeues(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """preempt.signal=USR2: `hpc-ddp render` writes --signal=USR2@120 and the ranks check it."""
    work = prepare_workdir(tmp_path / "slurm")
    render = [sys.executable, "-m", "hpc_ddp", "render", "--gpus-per-node", "2", "--time", "10",
              "--log-dir", str(work)]  # fmt: skip
    rendered = slurm.run(
        [*render, "-o", "job.sh", "configs/synthetic.yaml", "preempt.signal=USR2"], work
    )
    assert rendered.returncode == 0, rendered.stderr
    assert "#SBATCH --signal=USR2@120" in (work / "job.sh").read_text()
    job, _log, stop_step = preempt_and_wait(
        slurm, work, [str(work / "job.sh")], "hpc-ddp", ["preempt.signal=USR2"], "USR2"
    )
    assert slurm.job_field(job, "Restarts") == "1"
    assert 0 < stop_step < 400
    assert read_summary(work / "runs")["global_step"] == 400


def test_a_job_whose_warning_signal_the_ranks_do_not_handle_fails_at_start(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """slurm/train.sh asks for USR1; ranks told to handle USR2 refuse before training."""
    work = prepare_workdir(tmp_path / "slurm")
    job = slurm.sbatch(
        [
            "--ntasks-per-node=2",
            TRAIN,
            "configs/synthetic.yaml",
            f"run.output_dir={work / 'runs'}",
            "preempt.signal=USR2",
        ],
        work,
    )
    # The refusal is in the log; a job that did not refuse would train on and complete.
    assert slurm.wait(job, timeout=300) == "FAILED"
    log = (work / f"hpc-ddp-{job}.out").read_text()
    assert "the job's warning signal is 'USR1'" in log and "preempt.signal=USR2" in log, log
    assert "HINT: make the two equal" in log and "Traceback" not in log
    assert not (work / "runs").exists(), "refused before any run directory"


def test_torchrun_template_survives_the_warning_signal_and_the_job_resumes(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """Slurm signals every process of the step, torchrun's agent too. The agent must handle
    the warning signal (not die of it, which ends the step while the ranks checkpoint); the
    ranks stop after the same step, rank 0 requeues, and the job resumes there."""
    work = prepare_workdir(tmp_path)
    _job, log, stop_step = preempt_and_wait(
        slurm,
        work,
        [str(REPO / "slurm" / "train-torchrun.sh")],
        "hpc-ddp-torchrun",
        ["tracking.enabled=false"],
    )
    assert "User defined signal 1" not in log, "torchrun died of the warning signal"
    assert "torchrun's agent does not handle" not in log
    summary = read_summary(work / "runs")
    assert summary["launcher"] == "torchelastic" and summary["restart_count"] == 1
    assert summary["resumed_from_step"] == stop_step and summary["global_step"] == 400


def test_torchrun_restarts_a_killed_worker_in_the_allocation_and_the_run_ends_exact(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """kill -9 of one rank under the torchrun template: its agent restarts every worker in
    the same allocation (no requeue), they resume from the newest checkpoint, and the job
    ends with the weights of an uninterrupted run, in one MLflow run."""
    work = prepare_workdir(tmp_path)
    killed = ["model.kind=custom", "model.factory=tests.factories:rank1_killed_once_checkpointed"]
    overrides = [*LONG, *killed, "checkpoint.every_steps=20"]
    job, summary = torchrun_job_losing_a_rank(slurm, work, [], overrides)
    assert slurm.job_field(job, "Restarts") == "0", "restarted in the allocation, not requeued"
    assert (summary["elastic_restarts"], summary["restart_count"]) == (1, 0)

    assert summary["weights_sha256"] == uninterrupted_weights(tmp_path, overrides)
    run = the_mlflow_run(work, job)
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    restarts = [tags[f"hpc_ddp.attempt.{n}.elastic_restarts"] for n in (0, 1)]
    assert restarts == ["0", "1"]

    # Rank 0 of the crashed round writes its account if torchrun's SIGTERM gives it time, or
    # the restarted round charges it as killed: either way the steps it took past the
    # checkpoint count as redone.
    crashed, restarted = attempts_of(work / "runs")
    assert crashed["status"] in {"failed", "stopped", "killed"}, crashed
    assert restarted["status"] == "finished"
    assert restarted["from_step"] == summary["resumed_from_step"]
    assert restarted["redone_steps"] == max(0, crashed["last_step"] - restarted["from_step"])
    assert summary["time_account"]["attempts_unaccounted"] == 0


@pytest.mark.slow
def test_torchrun_on_two_nodes_restarts_when_one_node_loses_a_rank(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """kill -9 of a rank on the second of 2 nodes: only that node's agent counts a restart,
    the other restarts its workers without counting. Every round of workers meets in a
    store of its own (not keyed by the agents' differing counts), the ranks agree on the
    count, and the job ends with the weights of an uninterrupted 4-rank run. Slow: the
    1-node test above pins the restart and its exact end; this one adds the second node."""
    work = prepare_workdir(tmp_path)
    killed = ["model.kind=custom", "model.factory=tests.factories:rank3_killed_once_checkpointed"]
    overrides = [*LONG, *killed, "checkpoint.every_steps=20", "tracking.enabled=false"]
    _job, summary = torchrun_job_losing_a_rank(slurm, work, ["--nodes=2"], overrides)
    assert (summary["world_size"], summary["num_nodes"]) == (4, 2)
    assert summary["elastic_restarts"] == 1
    assert summary["weights_sha256"] == uninterrupted_weights(tmp_path, overrides, nproc=4)


def test_time_limit_signal_checkpoints_and_a_resubmission_resumes(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """A job whose time limit comes within a minute or two stops with a checkpoint before
    it, is not requeued (preempt.max_requeues=0), and a resubmission with its run id resumes
    from that step.

    The limit is brought near (`scontrol update`) while the ranks hold at step 60, so that
    however long the start took, the same time is left. Slurm sends --signal=USR1@50 from a
    timer it checks about every 30 s, later on a busy machine (once not at all before the
    limit): rank 0's own reading of the job's end stops the job too, and whichever comes
    first stops it, so the verdict does not wait on Slurm's timer. Its 120 s margin, more
    than is left, stops the ranks as soon as rank 0 has read the new end, which leaves a
    minute or more for the stop, the save and the exit however busy the machine is."""
    work = prepare_workdir(tmp_path)
    runs = work / "runs"
    common = [
        "configs/synthetic.yaml",
        f"run.output_dir={runs}",
        "tracking.enabled=false",
        "data.num_samples=25600",
        "data.batch_size=64",
        *RELEASED,
    ]
    job = slurm.sbatch(
        [
            "--ntasks-per-node=2",
            "--time=10",
            "--signal=USR1@50",
            TRAIN,
            *common,
            "train.epochs=100000",
            "preempt.max_requeues=0",
            "preempt.end_margin_s=120",
            "preempt.end_check_every_s=1",
            "train.log_interval=100",
        ],
        work,
    )
    log_path = work / f"hpc-ddp-{job}.out"
    slurm.wait_for_log(log_path, r"HOLDING at step 60 \(rank 0\)")
    short = minutes_from_now(slurm.job_field(job, "RunTime"), 1)  # 60 to 120 s from now
    before_update = len(log_path.read_text())
    assert (
        slurm.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={short}"], work).returncode
        == 0
    )
    slurm.wait_for_log(log_path, r"the job's end moved -\d+ s", since=before_update)
    (runs / "release").touch()
    state = slurm.wait(job, timeout=300)
    log = (work / f"hpc-ddp-{job}.out").read_text()
    assert state != "TIMEOUT", "the signal's lead time was used to stop before the limit"
    assert "not requeueing: the job was already requeued 0 time(s), preempt.max_requeues=0" in log
    stop_step = int(re.search(r"checkpoint \(stop signal\) step (\d+)", log).group(1))  # type: ignore[union-attr]
    checkpoints = list_checkpoints(runs / "synthetic-mlp" / job / "checkpoints")
    assert checkpoints and checkpoints[0].name == f"step-{stop_step:09d}"

    again = slurm.sbatch(
        [
            "--ntasks-per-node=2",
            TRAIN,
            *common,
            f"run.id={job}",
            "train.epochs=100000",
            f"train.max_steps={stop_step + 30}",
        ],
        work,
    )
    assert slurm.wait(again) == "COMPLETED"
    resumed_log = (work / f"hpc-ddp-{again}.out").read_text()
    assert f"at step {stop_step}" in resumed_log
    summary = read_summary(work / "runs")
    assert summary["resumed_from_step"] == stop_step and summary["global_step"] == stop_step + 30


def test_a_rank_killed_on_one_node_leaves_it_out_and_the_job_resumes_on_the_others(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """Rank 1 of a 2-node job is killed by SIGKILL (as a failing host kills it) at step 12, after
    the checkpoint of step 8. srun ends the step at once (not after dist.timeout_s) naming the
    task; the batch script leaves that task's node out of the job (ExcNodeList) and requeues
    it; the next attempt runs on the other two nodes from step 8 and ends with the weights of a
    run that was never killed."""
    work, settings, job, log, node = left_a_node_out(slurm, tmp_path, "killed_model")
    why = f"task 1 on {node} was killed by SIGKILL"
    assert f"hpc-ddp: {why}: left {node} out of job {job} (ExcNodeList: {node})" in log, log[-3000:]
    run_dir = next((work / "runs").glob(f"*/{job}"))
    failures = json.loads((run_dir / "excluded_hosts.json").read_text())
    assert [(f["job"], f["hosts"], f["event"], f["why"], f["requeued"]) for f in failures] == [
        (job, [node], "lost a rank", [why], True)
    ]
    listed = slurm.run([sys.executable, "-m", "hpc_ddp", "runs", str(work / "runs")], work)
    assert f"job {job} attempt 0: {node} lost a rank ({why}): left out" in listed.stdout, (
        listed.stdout
    )
    resumed_without(slurm, job, node, 8, settings, work, log)


def test_a_rank_lost_while_its_model_is_built_leaves_its_node_out_too(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """Rank 1 of a 2-node job is killed (SIGKILL, as by a failing host) while it builds the
    model, before the first step and any checkpoint. Rank 0 handed the run to the batch script
    when it claimed the run's directory, before the rendezvous, so the node is left out and the
    job requeued as for a rank lost mid-run; the next attempt trains from the start on the
    other two nodes to the weights of a run never killed."""
    work, settings, job, log, node = left_a_node_out(slurm, tmp_path, "killed_while_building")
    assert "rank 0 said nothing of its run" not in log, log[-3000:]
    why = f"task 1 on {node} was killed by SIGKILL"
    assert f"hpc-ddp: {why}: left {node} out of job {job} (ExcNodeList: {node})" in log, log[-3000:]
    run_dir = next((work / "runs").glob(f"*/{job}"))
    failures = json.loads((run_dir / "excluded_hosts.json").read_text())
    assert [(f["hosts"], f["event"], f["restart_count"], f["requeued"]) for f in failures] == [
        ([node], "lost a rank before training", 0, True)
    ]
    resumed_without(slurm, job, node, None, settings, work, log)


def left_a_node_out(
    slurm: SlurmCluster, tmp_path: Path, factory: str
) -> tuple[Path, list[str], str, str, str]:
    """A 2-node train.sh job of tests.factories' ``factory`` (it SIGKILLs rank 1 in the
    first attempt), checkpointing every 8 steps, run to COMPLETED: its work folder,
    settings, id, log and the node srun named for the killed task."""
    work = prepare_workdir(tmp_path)
    settings = ["model.kind=custom", f"model.factory=tests.factories:{factory}",
                "checkpoint.every_steps=8", "checkpoint.save_mode=single_file",
                "tracking.enabled=false", *SMALL]  # fmt: skip
    job = slurm.sbatch(
        ["--nodes=2", "--ntasks-per-node=1", TRAIN, "configs/synthetic.yaml",
         f"run.output_dir={work / 'runs'}", *settings],
        work,
    )  # fmt: skip
    state = slurm.wait(job, timeout=300)
    log = (work / f"hpc-ddp-{job}.out").read_text()
    assert state == "COMPLETED", (state, log[-3000:])
    killed = re.search(r"srun: error: (\S+): task 1: Killed", log)
    assert killed, log[-3000:]
    node = killed.group(1)
    return work, settings, job, log, node


def resumed_without(
    slurm: SlurmCluster,
    job: str,
    node: str,
    from_step: int | None,
    settings: list[str],
    work: Path,
    log: str,
) -> None:
    """``job`` (submitted from ``work``, its output ``log``) left ``node`` out and was
    requeued once; its second attempt ran on the other two nodes from ``from_step`` (None: from
    the start, no checkpoint had been written) and ended
    with the weights of a local run of ``settings`` never stopped, on as many threads a rank
    (a CPU's sums change with the thread count: the torchrun template's one rank a node takes
    both of a node's CPUs, `hpc-ddp local` shares this machine's between its ranks)."""
    assert slurm.job_field(job, "ExcNodeList") == node and slurm.job_field(job, "Restarts") == "1"
    ran_on = slurm.run(["scontrol", "show", "hostnames", slurm.job_field(job, "NodeList")], work)
    assert node not in ran_on.stdout.split() and len(ran_on.stdout.split()) == 2
    summary = read_summary(work / "runs")
    assert (summary["restart_count"], summary["resumed_from_step"]) == (1, from_step)
    threads = set(re.findall(r"\] INFO host .* threads (\d+)$", log, re.MULTILINE))
    assert len(threads) == 1, threads
    environment = clean_environ(OMP_NUM_THREADS=threads.pop())
    reference = run_local(2, work / "reference", settings, environment=environment)
    assert reference.returncode == 0, reference.stderr[-2000:]
    assert summary["weights_sha256"] == read_summary(work / "reference")["weights_sha256"]


def test_under_torchrun_a_node_whose_rank_dies_past_the_restarts_is_left_out(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """The torchrun template on 2 nodes, one rank each: rank 1 is killed (SIGKILL) at every
    round's 12th step of the job's first attempt, as on a failing host. torchrun restarts
    the workers in the allocation once (TORCHRUN_MAX_RESTARTS=1), the second round dies
    too, and the batch script reads torchrun's report: it leaves the dead rank's node out and
    requeues; the next attempt runs on the other two nodes from the last checkpoint (step
    16) and ends with the weights of a run never killed."""
    work = prepare_workdir(tmp_path)
    settings = ["model.kind=custom", "model.factory=tests.factories:killed_model",
                "checkpoint.every_steps=8", "checkpoint.save_mode=single_file",
                "tracking.enabled=false", *SMALL]  # fmt: skip
    job = slurm.sbatch(
        ["--nodes=2", "--export=ALL,NPROC_PER_NODE=1,TORCHRUN_MAX_RESTARTS=1",
         str(REPO / "slurm" / "train-torchrun.sh"), "configs/synthetic.yaml",
         f"run.output_dir={work / 'runs'}", *settings],
        work,
    )  # fmt: skip
    state = slurm.wait(job, timeout=300)
    log = (work / f"hpc-ddp-torchrun-{job}.out").read_text()
    assert state == "COMPLETED", (state, log[-4000:])
    # The node of rank 1 in the first attempt: srun's label on its lines is its agent's task,
    # task N the N-th node of the attempt's node list.
    first_attempt = re.search(r"^job \d+ on (\S+): torchrun on 2 node\(s\)", log, re.MULTILINE)
    task = re.search(r"^(\d+): .*\[rank 1/2\] INFO host", log, re.MULTILINE)
    assert first_attempt and task, log[-4000:]
    hostnames = ["scontrol", "show", "hostnames", first_attempt.group(1)]
    nodes = slurm.run(hostnames, work).stdout.split()
    why = re.search(r"hpc-ddp: rank 1 on (\S+) \(torchrun's restarts ran out\) was killed by "
                    r"SIGKILL: left (\S+) out of job", log)  # fmt: skip
    assert why, log[-4000:]
    node = why.group(1)
    assert node == nodes[int(task.group(1))], "the node rank 1 ran on, named by srun's label"
    assert why.group(2) == node
    resumed_without(slurm, job, node, 16, settings, work, log)


def test_a_frozen_rank_is_found_by_the_others_its_node_left_out_and_the_job_resumed(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """Rank 1 of a 2-node job freezes at step 12 (SIGSTOP: a host that hangs answers nothing,
    and its rank cannot say so), after the checkpoint of step 8. Rank 0 waits in the
    gradients' all-reduce until its stall watchdog (dist.stall_timeout_s) ends it, naming rank
    1 and its node as no longer answering; srun ends the step (the frozen task, woken to be
    ended, also exits as having lost its peer), and the batch script leaves the node the
    report named out of the job, which is requeued; the next attempt on the other two nodes
    ends with the weights of a run never frozen."""
    work = prepare_workdir(tmp_path)
    settings = ["model.kind=custom", "model.factory=tests.factories:frozen_model",
                "checkpoint.every_steps=8", "checkpoint.save_mode=single_file",
                "tracking.enabled=false", *SMALL]  # fmt: skip
    job = slurm.sbatch(
        ["--nodes=2", "--ntasks-per-node=1", TRAIN, "configs/synthetic.yaml",
         f"run.output_dir={work / 'runs'}", "dist.stall_timeout_s=20", *settings],
        work,
    )  # fmt: skip
    state = slurm.wait(job, timeout=300)
    log = (work / f"hpc-ddp-{job}.out").read_text()
    assert state == "COMPLETED", (state, log[-3000:])
    silent = re.search(r"these ranks stopped answering: rank 1 on (\S+) \(silent", log)
    assert silent, log[-3000:]
    node = silent.group(1)
    why = f"rank 1 on {node} stopped answering"
    assert f"hpc-ddp: {why}: left {node} out of job {job} (ExcNodeList: {node})" in log, log[-3000:]
    resumed_without(slurm, job, node, 8, settings, work, log)


def test_a_rank_that_raises_ends_the_job_fast_naming_it(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    work = prepare_workdir(tmp_path)
    job = slurm.sbatch(
        [
            "--ntasks-per-node=2",
            TRAIN,
            "configs/synthetic.yaml",
            f"run.output_dir={work / 'runs'}",
            "tracking.enabled=false",
            "model.kind=custom",
            "model.factory=tests.factories:failing_model",
        ],
        work,
    )
    # Rank 0 would otherwise wait dist.timeout_s (600 s) for the rank that raised: ended in
    # half of that, the job did not wait it out, however busy the machine.
    assert slurm.wait(job, timeout=300) == "FAILED"
    log = (work / f"hpc-ddp-{job}.out").read_text()
    assert "[rank 1] failed:" in log and "injected failure on rank 1" in log
    # srun names rank 1 alone, or rank 0 with it when rank 0's collective failed first.
    assert re.search(r"tasks? (1|0-1): Exited with exit code 1", log), log[-2000:]


def partial_writes(checkpoints: Path) -> list[Path]:
    """What writers killed mid-save leave: a single file's temporary, or a folder without
    its .metadata."""
    if not checkpoints.is_dir():
        return []
    folders = [path for path in checkpoints.glob("step-*") if path.is_dir()]
    return [*checkpoints.glob(".step-*.tmp-*"), *(f for f in folders if not is_complete(f))]


@pytest.mark.parametrize("save_mode", ["async", "single_file"])
def test_kill_during_a_checkpoint_write_keeps_the_previous_one(
    slurm: SlurmCluster, tmp_path: Path, save_mode: str
) -> None:
    work = prepare_workdir(tmp_path)
    common = [
        "configs/synthetic.yaml",
        f"checkpoint.save_mode={save_mode}",
        f"run.output_dir={work / 'runs'}",
        "tracking.enabled=false",
        "model.hidden_sizes=[2048, 2048]",
        "data.batch_size=32",
        "checkpoint.every_steps=5",
        "checkpoint.keep_last=2",
        "train.epochs=1000",
        # A rank killed outright is read as its host's loss: no requeue on another node here.
        "preempt.max_node_failures=0",
    ]
    job = slurm.sbatch(["--ntasks-per-node=2", TRAIN, *common], work)
    checkpoints = work / "runs" / "synthetic-mlp" / job / "checkpoints"
    writer = rank_pid(job, 0, timeout=90)
    deadline = time.monotonic() + 120
    partial: list[Path] = []
    while time.monotonic() < deadline:
        complete = list_checkpoints(checkpoints)
        partial = partial_writes(checkpoints)
        if complete and partial:
            os.kill(writer, signal.SIGKILL)
            break
        time.sleep(0.002)
    assert partial, "never caught a checkpoint being written"
    # The other rank would otherwise wait dist.timeout_s (600 s) for the killed one.
    assert slurm.wait(job, timeout=300) == "FAILED"
    first_log = (work / f"hpc-ddp-{job}.out").read_text()
    assert re.search(r"task 0: Killed", first_log), first_log[-2000:]
    previous = list_checkpoints(checkpoints)[0]
    previous_step = int(load_checkpoint(previous)["global_step"])

    again = slurm.sbatch(
        [
            "--ntasks-per-node=2",
            TRAIN,
            *common,
            f"run.id={job}",
            f"train.max_steps={previous_step + 3}",
        ],
        work,
    )
    assert slurm.wait(again) == "COMPLETED"
    log = (work / f"hpc-ddp-{again}.out").read_text()
    assert f"resumed from {previous} at step {previous_step}" in log
    assert not partial_writes(checkpoints), "the partial write was cleaned up"
    assert read_summary(work / "runs")["global_step"] == previous_step + 3


def test_submitit_preemption_requeues_and_resumes_to_the_same_weights(
    slurm: SlurmCluster, slurm_conf_in_environ: None, tmp_path: Path
) -> None:
    overrides = [*HELD, *LONG, "tracking.enabled=false"]
    job = submit(
        REPO / "configs" / "synthetic.yaml",
        cluster="slurm",
        gpus_per_node=2,
        folder=tmp_path / "submitit",
        overrides=[*overrides, f"run.output_dir={tmp_path / 'runs'}"],
        time="00:20:00",
    )
    for rank in (0, 1):  # every rank holds after its step-60 stop check
        log_path = tmp_path / "submitit" / f"{job.job_id}_{rank}_log.err"
        slurm.wait_for_log(log_path, rf"HOLDING at step 60 \(rank {rank}\)")
    job._interrupt()
    results = wait(job)
    assert len(results) == 2
    rank0 = results[0]
    assert rank0["restart_count"] == 1 and rank0["resumed_from_step"] == HELD_STOP_STEP
    assert rank0["global_step"] == 400
    assert rank0["weights_sha256"] == uninterrupted_weights(tmp_path, overrides)
    assert summary_path(tmp_path / "runs").parent.name == str(job.job_id)
