"""Rank 0's MLflow client in its own process: it outlives the job's signals, stores every
call before it answers, and leaves nothing behind."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from hpc_ddp.runtime.exits import rank_label
from hpc_ddp.runtime.tracking.base import (
    MAX_METRICS_PER_CALL,
    LoggedMetrics,
    RunRecord,
    default_tracking_uri,
)
from hpc_ddp.runtime.tracking.mlflow_import import LEFT_OUT, MLFLOW_HTTP_SETTINGS
from hpc_ddp.runtime.tracking.worker import (
    STEADY_NICE,
    WorkerTracker,
    _prestarted,
    discard_prestarted,
    prestart,
    probably_rank_0,
    spawn_worker,
    take_prestarted,
)
from tests.helpers import REPO, clean_environ


def _start(tmp_path: Path) -> WorkerTracker:
    record = RunRecord(name="worker", params={"lr": 0.1}, tags={"hpc_ddp.world_size": "2"})
    return WorkerTracker(
        default_tracking_uri(tmp_path), "worker-test", tmp_path / "artifacts", record, (0, 2)
    )


@pytest.mark.e2e
def test_the_worker_ignores_job_signals_and_ends_with_the_run(tmp_path: Path) -> None:
    tracker = _start(tmp_path)
    child = tracker._process
    for number in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        os.kill(child.pid, number)  # what Slurm sends every process of a step
    tracker.log_metrics({"loss": 0.5}, 3)
    tracker.log_json_artifact("summary.json", {"global_step": 3})
    tracker.finish("FINISHED")
    assert child.poll() == 0, "the worker exits as soon as the run is ended"
    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path))
    run = client.get_run(str(tracker.run_id))
    assert run.info.status == "FINISHED"
    assert run.data.metrics == {"loss": 0.5}
    assert run.data.params == {"lr": "0.1"}
    assert [item.path for item in client.list_artifacts(run.info.run_id)] == ["summary.json"]


@pytest.mark.e2e
def test_the_worker_steps_down_in_priority_once_its_mlflow_run_exists(tmp_path: Path) -> None:
    """mlflow's import and the run's creation at the rank's priority (a busy node must not
    starve them); the logging after at STEADY_NICE more, out of training's way."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    worker = spawn_worker()
    assert os.getpriority(os.PRIO_PROCESS, worker.process.pid) == own, "starting"
    record = RunRecord(name="worker", params={}, tags={})
    tracker = WorkerTracker(default_tracking_uri(tmp_path), "worker-test",
                            tmp_path / "artifacts", record, (0, 1), worker)  # fmt: skip
    expected = min(own + STEADY_NICE, 19)
    # It steps down after answering the start: the next call's answer comes after that.
    tracker.log_metrics({"loss": 0.5}, 1)
    assert os.getpriority(os.PRIO_PROCESS, worker.process.pid) == expected, "the run exists"
    tracker.log_metrics({"loss": 0.25}, 2)
    assert os.getpriority(os.PRIO_PROCESS, worker.process.pid) == expected, "stepped down once"
    tracker.finish("FINISHED")


@pytest.mark.e2e
def test_metrics_of_many_steps_reach_mlflow_in_one_call_with_their_times(tmp_path: Path) -> None:
    """More metrics than MLflow takes in one call: all of them are stored, each at its step
    and the time it was logged."""
    tracker = _start(tmp_path)
    keys = [f"layer{i}/grad_norm" for i in range(500)]
    logged = [
        LoggedMetrics({key: step + i / 1000 for i, key in enumerate(keys)}, step, 1_000 * step)
        for step in (10, 20, 30)
    ]
    assert sum(len(point.metrics) for point in logged) > MAX_METRICS_PER_CALL
    tracker.log_metric_steps(logged)
    tracker.finish("FINISHED")
    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path))
    run = client.get_run(str(tracker.run_id))
    assert len(run.data.metrics) == 500 and run.data.metrics["layer7/grad_norm"] == 30.007
    history = client.get_metric_history(run.info.run_id, "layer499/grad_norm")
    assert sorted((m.step, m.timestamp, m.value) for m in history) == [
        (10, 10_000, 10.499),
        (20, 20_000, 20.499),
        (30, 30_000, 30.499),
    ]


@pytest.mark.e2e
def test_a_parent_that_goes_away_leaves_the_run_running(tmp_path: Path) -> None:
    """As a rank killed outright would: the next attempt reopens the same MLflow run."""
    tracker = _start(tmp_path)
    tracker.log_metrics({"loss": 0.25}, 1)
    tracker._connection.close()
    # (a hang guard: the process ends by itself once its parent's end of the pipe is closed)
    assert tracker._process.wait(timeout=300) == 0
    run = MlflowClient(tracking_uri=default_tracking_uri(tmp_path)).get_run(str(tracker.run_id))
    assert run.info.status == "RUNNING"
    assert run.data.metrics == {"loss": 0.25}


@pytest.mark.e2e
def test_a_suspended_run_can_still_be_ended(tmp_path: Path) -> None:
    """A stop that asked for a requeue suspends the run first; when the requeue is not
    possible, the run is ended KILLED after all."""
    tracker = _start(tmp_path)
    tracker.suspend()
    assert tracker._process.poll() is None, "a suspended run's worker waits for more"
    tracker.finish("KILLED")
    run = MlflowClient(tracking_uri=default_tracking_uri(tmp_path)).get_run(str(tracker.run_id))
    assert run.info.status == "KILLED"
    assert tracker._process.poll() == 0


def test_only_rank_0_prestarts_a_worker_and_only_while_tracking_is_on() -> None:
    discard_prestarted()  # one an earlier in-process call may have left
    environ = clean_environ()
    assert not prestart({**environ, "RANK": "1"}, [])
    assert not prestart({**environ, "RANK": "3", "SLURM_PROCID": "0"}, []), "torchrun's rank"
    assert not prestart({**environ, "SLURM_PROCID": "0"}, ["--lr", "1", "tracking.enabled=false"])
    assert not prestart({**environ, "HPC_DDP_OVERRIDES": "run.id=a tracking.enabled=false"}, [])
    assert take_prestarted() is None


@pytest.mark.e2e
def test_a_prestarted_worker_is_handed_over_once_and_drives_the_run(tmp_path: Path) -> None:
    assert prestart({**clean_environ(), "SLURM_PROCID": "0"}, ["--lr", "1"])
    worker = take_prestarted()
    assert worker is not None and worker.process.poll() is None
    assert take_prestarted() is None, "handed over once"
    record = RunRecord(name="early", params={"lr": 1}, tags={"hpc_ddp.world_size": "1"})
    tracker = WorkerTracker(
        default_tracking_uri(tmp_path), "early", tmp_path / "artifacts", record, worker=worker
    )
    tracker.log_metrics({"loss": 0.25}, 1)
    tracker.finish("FINISHED")
    run = MlflowClient(tracking_uri=default_tracking_uri(tmp_path)).get_run(str(tracker.run_id))
    assert (run.info.status, run.data.metrics) == ("FINISHED", {"loss": 0.25})


@pytest.mark.e2e
def test_a_prestarted_worker_that_no_run_uses_is_ended_untouched(tmp_path: Path) -> None:
    assert prestart({**clean_environ(), "RANK": "0"}, [])
    process = _prestarted[-1].process
    discard_prestarted()
    assert process.returncode == -signal.SIGKILL and take_prestarted() is None


@pytest.mark.e2e
def test_the_worker_gets_short_http_retries_unless_the_user_set_them() -> None:
    """MLflow reads its HTTP retry settings from its environment only: a prestarted worker
    and one started later must both get them, and the user's own values must win."""
    assert prestart({**clean_environ(), "RANK": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "99"}, [])
    process, connection = _prestarted[-1].process, _prestarted[-1].connection
    try:
        # Popen returns once the exec closed its pipe, before the kernel has laid out the new
        # program's environment (/proc then shows none): an answered call (an error, no
        # run was started) says the child runs Python, its environment in place.
        connection.send(("run_id", ()))
        assert connection.recv()[0] == "error"
        lines = Path(f"/proc/{process.pid}/environ").read_bytes().split(b"\0")
        seen = dict(line.decode().split("=", 1) for line in lines if b"=" in line)
    finally:
        discard_prestarted()
    assert (
        seen["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]
        == MLFLOW_HTTP_SETTINGS["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]
    )
    assert seen["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "99", "the user's value wins"


def test_the_rank_is_read_as_torchrun_numbers_it_inside_a_slurm_job() -> None:
    """Under torchrun in a Slurm job, SLURM_PROCID numbers the agents: RANK is the rank."""
    torchrun_in_slurm = {"RANK": "5", "SLURM_PROCID": "0"}
    assert rank_label(torchrun_in_slurm) == "5"
    assert not probably_rank_0(torchrun_in_slurm)
    assert rank_label({"SLURM_PROCID": "2"}) == "2"
    assert rank_label({"SUBMITIT_LOCAL_GLOBALID": "1"}) == "1"
    assert probably_rank_0({})


@pytest.mark.e2e
def test_the_tracking_process_leaves_the_data_science_stack_out(tmp_path: Path) -> None:
    """mlflow's full install imports pandas, numpy, scipy and pyarrow (0.4 s of CPU) that
    logging a run never uses: the worker runs a whole run without loading any of them."""
    tracker = _start(tmp_path)
    tracker.log_metrics({"loss": 0.5}, 3)
    tracker.log_json_artifact("summary.json", {"global_step": 3})
    maps = Path(f"/proc/{tracker._process.pid}/maps").read_text()
    tracker.finish("FINISHED")
    loaded = [name for name in LEFT_OUT if f"/site-packages/{name}/" in maps]
    assert loaded == [], f"the worker loaded {loaded}"
    run = MlflowClient(tracking_uri=default_tracking_uri(tmp_path)).get_run(str(tracker.run_id))
    assert (run.info.status, run.data.metrics) == ("FINISHED", {"loss": 0.5})


@pytest.mark.e2e
def test_a_call_that_wants_a_left_out_package_gets_it() -> None:
    """Should an mlflow version need numpy for a call after all, the call is made again
    with the packages let in, and it answers."""
    code = """
import sys
from hpc_ddp.runtime.tracking.mlflow_import import import_mlflow
from hpc_ddp.runtime.tracking.worker import answer_call
import_mlflow()
assert "mlflow" in sys.modules and sys.modules["numpy"] is None

class WantsNumpy:
    def log_metrics(self, metrics, step):
        import numpy
        return float(numpy.float64(metrics["loss"]) * step)

print(answer_call(WantsNumpy(), "log_metrics", ({"loss": 0.5}, 4))[1])
"""
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO, env=clean_environ(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["2.0"]


@pytest.mark.e2e
def test_a_catch_up_that_fails_is_said_once_and_tracking_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An attempt after another whose record cannot be replayed (its tracking.json is gone):
    one warning names the sync that sends the points later; the MLflow run tracks on."""
    record = RunRecord(name="worker", params={}, tags={}, start_step=20, earlier_attempts=1)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with caplog.at_level(logging.WARNING, logger="hpc_ddp"):
        tracker = WorkerTracker(
            default_tracking_uri(tmp_path),
            "worker-test",
            tmp_path / "artifacts",
            record,
            (0, 1),
            catch_up=run_dir,
        )
    [said] = [r.message for r in caplog.records if "earlier attempts left out" in r.message]
    assert "has no tracking.json" in said and f"hpc-ddp tracking sync {run_dir}" in said, said
    tracker.log_metrics({"loss": 0.5}, 21)
    tracker.finish("FINISHED")
    run = MlflowClient(tracking_uri=default_tracking_uri(tmp_path)).get_run(str(tracker.run_id))
    assert run.info.status == "FINISHED" and run.data.metrics == {"loss": 0.5}
    assert run.data.tags["hpc_ddp.attempts"] == "2"
