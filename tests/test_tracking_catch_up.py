"""An attempt's MLflow run catches up with what the attempts before it left out of MLflow:
a real MLflow store (SQLite) and a run directory's record as attempts leave it. The whole
path, with real ranks and a real `mlflow server` that was down for the first attempt, is in
test_tracking_outage."""

from __future__ import annotations

import json
from pathlib import Path

from mlflow import MlflowClient

from hpc_ddp.runtime.tracking.base import RunRecord
from hpc_ddp.runtime.tracking.mlflow_tracker import MlflowTracker

#: When the second attempt began (Unix s): the first one logged before it.
SECOND_BEGAN = 1_000_000.0


def first_attempt_record(run_dir: Path, uri: str, run_id: str | None) -> None:
    """Attempt 1 logged steps 10 to 40 and its checkpoint was at step 20; attempt 2 began
    from there and logged step 30 again."""
    lines = [
        {"attempt": 1, "from_step": 0, "time": 1.0},
        *(
            {"step": step, "time": 1.0 + step, "metrics": {"loss": step / 10}}
            for step in (10, 20, 30, 40)
        ),
        {"attempt": 2, "from_step": 20, "time": SECOND_BEGAN + 5},
        {"step": 30, "time": SECOND_BEGAN + 6, "metrics": {"loss": 9.0}},
    ]  # fmt: skip
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    tracking = {"uri": uri, "experiment": "catch-up", "run_name": "r/1", "run_id": run_id}
    (run_dir / "tracking.json").write_text(json.dumps(tracking))


def second_attempt(uri: str, tmp_path: Path, resume_run_id: str | None) -> MlflowTracker:
    record = RunRecord(
        name="r/1",
        params={"lr": 0.1},
        tags={},
        resume_run_id=resume_run_id,
        start_step=20,
        attempt_token="second",
        start_time_ms=int(SECOND_BEGAN * 1000),
        earlier_attempts=1,
    )
    return MlflowTracker(uri, "catch-up", tmp_path / "artifacts", record)


def losses(uri: str, run_id: str | None) -> list[tuple[int, float]]:
    history = MlflowClient(tracking_uri=uri).get_metric_history(str(run_id), "loss")
    return sorted((metric.step, metric.value) for metric in history)


def test_a_new_mlflow_run_for_a_run_with_earlier_attempts_gets_their_points(
    tmp_path: Path,
) -> None:
    """Attempt 1 tracked into another store (tracking.uri changed), so attempt 2 makes a new
    MLflow run, though its status.json said attempt 1's tracking was whole: the new run
    still gets attempt 1's points, up to the step attempt 2 began from."""
    uri = f"sqlite:///{tmp_path / 'new.db'}"
    first_attempt_record(tmp_path / "run", "sqlite:///elsewhere.db", "in-another-store")
    tracker = second_attempt(uri, tmp_path, resume_run_id="in-another-store")
    assert tracker.created
    assert tracker.catch_up(str(tmp_path / "run"), behind=False) == 2
    assert losses(uri, tracker.run_id) == [(10, 1.0), (20, 2.0)]
    tags = MlflowClient(tracking_uri=uri).get_run(str(tracker.run_id)).data.tags
    assert tags["hpc_ddp.attempts"] == "2" and tags["hpc_ddp.attempt.1.start_step"] == "20"
    assert "hpc_ddp.synced_from" not in tags, "the run's own MLflow run, not a sync's"


def test_a_reopened_run_gets_only_the_points_it_lacks_and_only_when_behind(
    tmp_path: Path,
) -> None:
    """Attempt 1's MLflow run got step 10 before MLflow failed. Reopened by attempt 2 with
    attempt 1's tracking whole, nothing is replayed; behind, step 20 is added and step 10
    is not sent twice."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("catch-up")).info.run_id
    client.log_metric(run_id, "loss", 1.0, step=10)
    first_attempt_record(tmp_path / "run", uri, run_id)

    whole = second_attempt(uri, tmp_path, resume_run_id=run_id)
    assert not whole.created and whole.catch_up(str(tmp_path / "run"), behind=False) == 0
    assert losses(uri, run_id) == [(10, 1.0)]

    behind = second_attempt(uri, tmp_path, resume_run_id=run_id)
    assert behind.catch_up(str(tmp_path / "run"), behind=True) == 1
    assert losses(uri, run_id) == [(10, 1.0), (20, 2.0)]
    assert client.get_run(run_id).info.status == "RUNNING", "the attempt tracks on in it"
