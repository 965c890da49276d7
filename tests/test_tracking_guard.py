"""Rank 0's hand-over to MLflow: the calls run in order on a background thread, and metrics
logged close together go to MLflow in one call. The store behind it is a recording stand-in
here (what reaches a real MLflow store is in test_tracking_worker and test_tracking_outage),
but for the refused call, which a real SQLite store refuses."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from hpc_ddp.runtime.names import name_problem
from hpc_ddp.runtime.tracking.base import LoggedMetrics, RunRecord, experiment_folder
from hpc_ddp.runtime.tracking.guard import GuardedTracker
from hpc_ddp.runtime.tracking.mlflow_tracker import MlflowTracker


class RecordingStore:
    """Records each call; its start waits until the test lets it go, as MLflow's import
    does, so that calls pile up behind it."""

    run_id = "recorded"
    status = "ok"

    def __init__(self, go: threading.Event, answer: threading.Event | None = None) -> None:
        self.go = go
        #: finish() and suspend() answer once this is set (by default at once).
        self.answer = answer or threading.Event()
        if answer is None:
            self.answer.set()
        self.calls: list[tuple[str, Any]] = []
        self.times: list[int] = []
        self.ended_ms: int | None = None
        self._recorded = threading.Condition()

    def record(self, call: tuple[str, Any]) -> None:
        with self._recorded:
            self.calls.append(call)
            self._recorded.notify_all()

    def wait_for_calls(self, count: int) -> None:
        """Until ``count`` calls reached the store (bounded: 30 s, then the test fails)."""
        with self._recorded:
            made = self._recorded.wait_for(lambda: len(self.calls) >= count, timeout=30)
        assert made, f"{len(self.calls)} call(s) reached the store in 30 s, not {count}"

    def started(self) -> RecordingStore:
        self.go.wait(30)
        return self

    def log_metrics(self, metrics: Any, step: int) -> None:
        self.record(("log_metrics", (metrics, step)))

    def log_metric_steps(self, logged: Sequence[LoggedMetrics]) -> None:
        self.times += [p.time_ms for p in logged]
        self.record(("log_metric_steps", [(dict(p.metrics), p.step) for p in logged]))

    def log_json_artifact(self, name: str, data: Any) -> None:
        self.record(("log_json_artifact", name))

    def log_text_artifact(self, name: str, text: str) -> None:
        self.record(("log_text_artifact", name))

    def set_tag(self, key: str, value: str) -> None:
        self.record(("set_tag", (key, value)))

    def finish(self, status: str, end_time_ms: int | None = None) -> None:
        self.answer.wait(30)
        self.ended_ms = end_time_ms
        self.record(("finish", status))

    def suspend(self) -> None:
        self.answer.wait(30)
        self.record(("suspend", None))


def test_metrics_logged_together_go_in_one_call_and_keep_their_order() -> None:
    go = threading.Event()
    store = RecordingStore(go)
    # A gather window far longer than the test: only another call or the end closes it.
    tracker = GuardedTracker(store.started, "stand-in", wait_limit_s=20, gather_s=600)
    before_ms = time.time() * 1000
    tracker.log_metrics({"loss": 2.0}, 1)
    tracker.log_metrics({"loss": 1.5, "lr": 0.1}, 2)
    tracker.log_json_artifact("config.json", {})
    tracker.log_metrics({"loss": 1.0}, 3)
    after_ms = time.time() * 1000
    go.set()  # MLflow started: the calls that piled up behind it go

    finishing_ms = time.time() * 1000
    tracker.finish("FINISHED")
    assert store.ended_ms is not None and store.ended_ms >= finishing_ms - 1, (
        "the run ends when finish() was called, which MLflow is told"
    )
    assert store.calls == [
        ("log_metric_steps", [({"loss": 2.0}, 1), ({"loss": 1.5, "lr": 0.1}, 2)]),
        ("log_json_artifact", "config.json"),
        ("log_metric_steps", [({"loss": 1.0}, 3)]),
        ("finish", "FINISHED"),
    ]
    assert tracker.status == "ok", "the end did not wait for the gather window"
    assert all(before_ms - 1 <= t <= after_ms + 1 for t in store.times), (
        "each point keeps the time it was logged at, not the time MLflow got it"
    )


def test_metrics_logged_a_window_apart_go_in_calls_of_their_own() -> None:
    go = threading.Event()
    go.set()
    store = RecordingStore(go)
    tracker = GuardedTracker(store.started, "stand-in", wait_limit_s=20, gather_s=0.2)
    tracker.log_metrics({"loss": 2.0}, 1)
    store.wait_for_calls(1)  # its window closed with nothing more: it went alone
    tracker.log_metrics({"loss": 1.0}, 2)
    tracker.finish("FINISHED")
    assert store.calls == [
        ("log_metric_steps", [({"loss": 2.0}, 1)]),
        ("log_metric_steps", [({"loss": 1.0}, 2)]),
        ("finish", "FINISHED"),
    ]


def test_a_process_cpu_time_is_read_from_proc_and_none_for_one_that_is_gone() -> None:
    import os

    from hpc_ddp.runtime.tracking.worker import cpu_seconds

    used = cpu_seconds(os.getpid())
    assert used is not None and used > 0
    assert sum(range(3_000_000)) and (cpu_seconds(os.getpid()) or 0) > used, "it grows"
    assert cpu_seconds(2**22 + 7) is None  # above Linux's largest pid


class WorkingProcess:
    """The tracking process's CPU time as the guard reads it: more at each look, so it is
    working; at look ``answer_at`` the store is let answer."""

    def __init__(self, answer: threading.Event, answer_at: int, grows: bool = True) -> None:
        self.answer, self.answer_at, self.grows = answer, answer_at, grows
        self.looks = 0

    def __call__(self) -> float:
        self.looks += 1
        if self.looks == self.answer_at:
            self.answer.set()
        return float(self.looks) if self.grows else 1.0


def test_the_end_waits_past_the_limit_while_the_tracking_process_works() -> None:
    """A busy machine slows the tracking process: the run's end waits for it for as long as
    its CPU time grows, however long each window is."""
    go, answer = threading.Event(), threading.Event()
    go.set()
    store = RecordingStore(go, answer)
    working = WorkingProcess(answer, answer_at=4)
    tracker = GuardedTracker(store.started, "stand-in", wait_limit_s=0.01, cpu_seconds=working)
    tracker.finish("FINISHED")
    assert tracker.status == "ok" and store.calls == [("finish", "FINISHED")]
    assert working.looks >= 4, "it waited three windows past the limit"


def test_the_end_gives_up_on_a_tracking_process_that_does_no_work() -> None:
    """A process stuck on a server that does not answer uses no CPU: the end gives it one
    window, then goes on without it, saying why."""
    go, answer = threading.Event(), threading.Event()
    go.set()
    idle = WorkingProcess(answer, answer_at=0, grows=False)
    tracker = GuardedTracker(
        RecordingStore(go, answer).started, "stand-in", wait_limit_s=0.01, cpu_seconds=idle
    )
    tracker.finish("FINISHED")
    assert tracker.status.startswith("failed: ending the run: TimeoutError: no answer within")
    assert tracker.status.endswith("(the tracking process did no work meanwhile)")
    assert idle.looks == 2, "the look before the wait and one after its window"
    answer.set()


@pytest.mark.parametrize(
    ("ending", "doing"),
    [("suspend", "suspending the run"), ("KILLED", "ending the run"), ("FAILED", "ending the run")],
)
def test_a_stop_or_a_failure_never_waits_past_the_limit(
    ending: str, doing: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before a requeue or at a stop the job's warning time runs, and a failure's report and
    the other ranks wait: a working but slow process is not waited for past the limit. The
    warning says where the points MLflow missed are and what brings them to it."""
    go, answer = threading.Event(), threading.Event()
    go.set()
    working = WorkingProcess(answer, answer_at=0)
    tracker = GuardedTracker(
        RecordingStore(go, answer).started, "stand-in", wait_limit_s=0.01, cpu_seconds=working
    )
    with caplog.at_level(logging.WARNING, logger="hpc_ddp"):
        if ending == "suspend":
            tracker.suspend()
        else:
            tracker.finish(ending)
    assert tracker.status == f"failed: {doing}: TimeoutError: no answer within 0 s"
    [warning] = [record.message for record in caplog.records if "MLflow at" in record.message]
    assert f"failed {doing}" in warning and "training goes on" not in warning, warning
    assert "next attempt sends MLflow what it lacks" in warning and "tracking sync" in warning
    answer.set()


def test_a_call_mlflow_refuses_is_dropped_and_tracking_goes_on(tmp_path: Path) -> None:
    """A real MLflow store (SQLite): a metric name it refuses (past the toolkit's own check,
    as an older record holds them) costs that call and one warning; the next metrics and
    the run's end still reach MLflow. The store works in this process (a thread): the end
    waits for it while this process works, as a run's end waits for its tracking process,
    so a starved machine that takes minutes to make the store fails nothing."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    record = RunRecord(name="refused/1", params={}, tags={})

    def start() -> MlflowTracker:
        return MlflowTracker(uri, "refusals", tmp_path / "artifacts", record)

    tracker = GuardedTracker(start, uri, gather_s=0.0, cpu_seconds=time.process_time)
    tracker.log_metrics({"loss@top1": 1.0}, 1)
    tracker.log_text_artifact("notes.txt", "kept")
    tracker.log_metrics({"loss": 2.0}, 2)
    tracker.finish("FINISHED")
    assert tracker.status == "ok"
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(str(tracker.run_id))
    assert run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [
        (2, 2.0)
    ]
    assert "loss@top1" not in run.data.metrics


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("loss@top1", "holds '@'"),
        ("a/../b", "reads as the path 'b'"),
        ("/abs", "reads as the path"),
        ("", "non-empty string"),
        ("x" * 251, "251 characters long"),
        (5, "non-empty string"),
    ],
)
def test_names_mlflow_refuses_are_named_with_the_reason(name: object, problem: str) -> None:
    found = name_problem(name)
    assert found is not None and problem in found, found
    assert name_problem("val/top-1 acc:5") is None and name_problem("interval/loss") is None


@pytest.mark.parametrize("experiment", ["../../escaped", "/etc", "a/b", ".", "..", "ok-name.1"])
def test_an_experiments_artifact_folder_stays_inside_the_artifact_root(
    tmp_path: Path, experiment: str
) -> None:
    """tracking.experiment is free text (MLflow allows '/'); its artifacts' folder is one
    plain name under the root, whatever the name holds."""
    folder = experiment_folder(tmp_path / "mlartifacts", experiment)
    assert folder.parent == tmp_path / "mlartifacts" and folder.name not in ("", ".", "..")
    assert folder.resolve().is_relative_to((tmp_path / "mlartifacts").resolve())
