"""Rank 0's hand-over to MLflow: the calls run in order on a background thread, and metrics
logged close together go to MLflow in one call. The store behind it is a recording stand-in
here (what reaches a real MLflow store is in test_tracking_worker and test_tracking_outage),
but for the refused call, which a real SQLite store refuses."""

from __future__ import annotations

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

    def __init__(self, go: threading.Event) -> None:
        self.go = go
        self.calls: list[tuple[str, Any]] = []
        self.times: list[int] = []
        self.ended_ms: int | None = None

    def started(self) -> RecordingStore:
        self.go.wait(30)
        return self

    def log_metrics(self, metrics: Any, step: int) -> None:
        self.calls.append(("log_metrics", (metrics, step)))

    def log_metric_steps(self, logged: Sequence[LoggedMetrics]) -> None:
        self.calls.append(("log_metric_steps", [(dict(p.metrics), p.step) for p in logged]))
        self.times += [p.time_ms for p in logged]

    def log_json_artifact(self, name: str, data: Any) -> None:
        self.calls.append(("log_json_artifact", name))

    def log_text_artifact(self, name: str, text: str) -> None:
        self.calls.append(("log_text_artifact", name))

    def finish(self, status: str, end_time_ms: int | None = None) -> None:
        self.calls.append(("finish", status))
        self.ended_ms = end_time_ms

    def suspend(self) -> None:
        self.calls.append(("suspend", None))


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
    time.sleep(0.1)  # MLflow still starting
    go.set()
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
    time.sleep(1.0)  # the window closed meanwhile
    tracker.log_metrics({"loss": 1.0}, 2)
    tracker.finish("FINISHED")
    assert store.calls == [
        ("log_metric_steps", [({"loss": 2.0}, 1)]),
        ("log_metric_steps", [({"loss": 1.0}, 2)]),
        ("finish", "FINISHED"),
    ]


def test_a_call_mlflow_refuses_is_dropped_and_tracking_goes_on(tmp_path: Path) -> None:
    """A real MLflow store (SQLite): a metric name it refuses (past the toolkit's own check,
    as an older record holds them) costs that call and one warning; the next metrics and
    the run's end still reach MLflow."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    record = RunRecord(name="refused/1", params={}, tags={})

    def start() -> MlflowTracker:
        return MlflowTracker(uri, "refusals", tmp_path / "artifacts", record)

    tracker = GuardedTracker(start, uri, wait_limit_s=60, gather_s=0.0)
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
