"""MLflow tracking from rank 0, read back from the real embedded store with MlflowClient."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from mlflow import MlflowClient

from hpc_ddp.runtime.tracking.base import default_tracking_uri
from tests.helpers import read_summary, run_local

pytestmark = pytest.mark.e2e  # every test here starts processes


def test_two_rank_run_is_tracked_once_with_params_metrics_tags_artifacts(tmp_path: Path) -> None:
    result = run_local(
        2,
        tmp_path,
        ["train.epochs=3", "tracking.experiment=tracked", "train.log_interval=5"],
        config="configs/digits.yaml",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Creating initial MLflow database tables" not in result.stderr, "routine, not news"
    unprefixed = [line for line in result.stderr.splitlines() if "[rank " not in line]
    assert not unprefixed, f"every line names its rank, MLflow's too: {unprefixed[:3]}"
    summary = read_summary(tmp_path)
    assert summary["tracking"] == "ok"
    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path))
    experiment = client.get_experiment_by_name("tracked")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, "only rank 0 creates a run"
    run = runs[0]
    assert run.info.run_id == summary["mlflow_run_id"]
    assert run.info.status == "FINISHED"
    assert run.data.params["data.batch_size"] == "64"
    assert run.data.params["train.epochs"] == "3"
    assert run.data.params["model.hidden_sizes"] == "[128, 128]"
    tags = run.data.tags
    assert tags["hpc_ddp.launcher"] == "local"
    assert tags["hpc_ddp.world_size"] == "2"
    assert tags["hpc_ddp.num_nodes"] == "1"
    assert tags["hpc_ddp.job_id"] == summary["job_id"]
    assert tags["mlflow.runName"] == f"digits-mlp/{summary['run_id']}"
    # The run's own start, not the tracking process's (it starts after training began), and
    # its end after the summary was written.
    assert run.info.start_time == int(summary["timeline"]["entry_unix"] * 1000)
    duration_s = (run.info.end_time - run.info.start_time) / 1000
    assert duration_s >= summary["wall_time_s"] - 0.002, (duration_s, summary["wall_time_s"])
    history = client.get_metric_history(run.info.run_id, "val_loss")
    epoch_steps = summary["global_step"] // 3
    assert [m.step for m in history] == [epoch_steps, 2 * epoch_steps, 3 * epoch_steps]
    train = client.get_metric_history(run.info.run_id, "train_loss")
    assert [m.step for m in train] == [m.step for m in history], "one step axis"
    assert history[-1].value == summary["val_loss"]
    assert {"train_loss", "val_accuracy", "interval/lr", "interval/samples_per_s"} <= set(
        run.data.metrics
    )
    assert "train_accuracy" not in run.data.metrics, "train accuracy is opt-in"
    interval = client.get_metric_history(run.info.run_id, "interval/train_loss")
    assert len(interval) == summary["global_step"] // 5
    artifacts = {item.path for item in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "config.yaml"} <= artifacts
    local = client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path / "dl"))
    assert json.loads(Path(local).read_text())["weights_sha256"] == summary["weights_sha256"]


def test_automatic_log_interval_is_measured_agreed_and_followed(tmp_path: Path) -> None:
    """train.log_interval=null: the first interval ends at step 20, where rank 0's step rate
    sets the period; every later interval ends at a multiple of the period it announced."""
    result = run_local(
        2,
        tmp_path,
        ["train.max_steps=90", "data.num_samples=16384", "tracking.experiment=auto"],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    announced = re.search(r"progress and interval metrics every (\d+) step", result.stderr)
    assert announced, result.stderr[-2000:]
    period = int(announced.group(1))
    assert 1 <= period <= 10000
    summary = read_summary(tmp_path)
    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path))
    history = client.get_metric_history(summary["mlflow_run_id"], "interval/train_loss")
    expected = [20] + [step for step in range(21, 91) if step % period == 0]
    assert sorted(m.step for m in history) == expected
