"""One MLflow run, driven with MLflow's client: created or reopened, tagged per attempt."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.tracking.base import (
    MAX_METRICS_PER_CALL,
    LoggedMetrics,
    RunRecord,
    experiment_folder,
    store_lock,
)
from hpc_ddp.runtime.tracking.mlflow_import import let_in

#: The run's code tags each attempt keeps a copy of, under hpc_ddp.attempt.N.<name>.
ATTEMPT_CODE_TAGS = {
    "git_commit": "mlflow.source.git.commit",
    "git_dirty": "hpc_ddp.code.git_dirty",
    "script_sha256": "hpc_ddp.code.script_sha256",
}


class MlflowTracker:
    """One MLflow run. Its calls block: GuardedTracker makes them on its own thread."""

    status = "ok"

    def __init__(
        self, tracking_uri: str, experiment: str, artifact_root: Path, record: RunRecord
    ) -> None:
        import mlflow
        from mlflow.entities import Param, RunTag

        from hpc_ddp.runtime.logs import adopt_logger

        adopt_logger("mlflow")  # after its import, which sets mlflow's own handler
        # Creating a new store's tables is routine, not news: two lines on every first run.
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
        self._mlflow = mlflow
        self._uri = tracking_uri
        self._client = mlflow.MlflowClient(tracking_uri=tracking_uri)
        resumed = self._reopen(record.resume_run_id) if record.resume_run_id else None
        tags, params, start_step = record.tags, record.params, record.start_step
        if resumed is None:
            experiment_id = self._experiment_id(experiment, artifact_root)
            run = self._client.create_run(
                experiment_id,
                start_time=record.start_time_ms,
                run_name=record.name,
                tags={"mlflow.runName": record.name},
            )
            resumed_tags: dict[str, str] = {}
            self._run = str(run.info.run_id)
        else:
            self._run, resumed_tags = resumed
        self.run_id: str | None = self._run
        #: Whether this made the MLflow run (none was named, or the one named is gone).
        self.created = resumed is None
        #: This attempt's start (Unix s) and the step it began from; the attempts before it.
        self._began = ((record.start_time_ms or time.time() * 1000) / 1000, start_step)
        self._earlier_attempts = record.earlier_attempts
        tagged = sum(1 for key in resumed_tags if key.endswith(".start_step"))
        attempt = max(tagged, record.earlier_attempts)
        for key, value in resumed_tags.items():
            if record.attempt_token and key.endswith(".token") and value == record.attempt_token:
                self._attempt_prefix = key.removesuffix(".token")  # this attempt, again
                return
        self._attempt_prefix = f"hpc_ddp.attempt.{attempt}"
        attempt_tags = {
            **tags,
            f"{self._attempt_prefix}.restart_count": tags.get("hpc_ddp.restart_count", "0"),
            f"{self._attempt_prefix}.elastic_restarts": tags.get("hpc_ddp.elastic_restarts", "0"),
            f"{self._attempt_prefix}.start_step": str(start_step),
            f"{self._attempt_prefix}.world_size": tags.get("hpc_ddp.world_size", ""),
            f"{self._attempt_prefix}.token": record.attempt_token,
            # What each attempt ran: a requeue runs whatever is on disk when it starts.
            **{
                f"{self._attempt_prefix}.{name}": tags[key]
                for name, key in ATTEMPT_CODE_TAGS.items()
                if key in tags
            },
            "hpc_ddp.attempts": str(attempt + 1),
        }
        # Params are written once: a resumed run may change harmless keys (e.g. epochs), and
        # MLflow refuses to overwrite a param with another value.
        self._client.log_batch(
            self._run,
            params=[] if resumed else [Param(key, str(value)) for key, value in params.items()],
            tags=[RunTag(key, value) for key, value in attempt_tags.items()],
        )

    def _reopen(self, run_id: str) -> tuple[str, dict[str, str]] | None:
        """The run a checkpoint names, set RUNNING again; None if the store lost it."""
        try:
            run = self._client.get_run(run_id)
        except self._mlflow.exceptions.MlflowException:
            from hpc_ddp.runtime.logs import get_logger

            get_logger().warning(
                f"MLflow run {run_id} from the checkpoint is gone; starting a new one"
            )
            return None
        self._client.update_run(run_id, status="RUNNING")
        return run_id, dict(run.data.tags)

    def _experiment_id(self, name: str, artifact_root: Path) -> str:
        existing = self._client.get_experiment_by_name(name)
        if existing is not None:
            return str(existing.experiment_id)
        try:
            return str(
                self._client.create_experiment(
                    name,
                    artifact_location=experiment_folder(artifact_root, name).resolve().as_uri(),
                )
            )
        except self._mlflow.exceptions.MlflowException:
            # Another job created it between our lookup and create.
            again = self._client.get_experiment_by_name(name)
            if again is None:
                raise
            return str(again.experiment_id)

    def catch_up(self, run_dir: str, behind: bool) -> int:
        """Replay into this run the points of the run's earlier attempts that MLflow lacks,
        from ``run_dir``'s record up to the step this attempt began from: where ``behind``
        (tracking.record.mlflow_behind) or where this made the MLflow run though attempts
        came before. The number of points added."""
        if not self._earlier_attempts or not (behind or self.created):
            return 0
        from hpc_ddp.runtime.tracking.sync import sync_run

        report = sync_run(Path(run_dir), self._uri, live=True, resumed=self._began, into=self._run)
        return report.added

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.log_metric_steps([LoggedMetrics(metrics, step, int(time.time() * 1000))])

    def log_metric_steps(self, logged: Sequence[LoggedMetrics]) -> None:
        from mlflow.entities import Metric

        batch = [
            Metric(key, float(value), point.time_ms, point.step)
            for point in logged
            for key, value in point.metrics.items()
        ]
        for first in range(0, len(batch), MAX_METRICS_PER_CALL):
            self._client.log_batch(self._run, metrics=batch[first : first + MAX_METRICS_PER_CALL])

    def log_json_artifact(self, name: str, data: Any) -> None:
        self._client.log_text(self._run, json.dumps(data, indent=2, sort_keys=True), name)

    def log_text_artifact(self, name: str, text: str) -> None:
        self._client.log_text(self._run, text, name)

    def set_tag(self, key: str, value: str) -> None:
        self._client.set_tag(self._run, key, value)

    def finish(self, status: str, end_time_ms: int | None = None) -> None:
        """End the run: FINISHED, FAILED or KILLED (stopped and not requeued), at
        ``end_time_ms`` (Unix ms; default now)."""
        self._client.set_tag(self._run, f"{self._attempt_prefix}.end", status.lower())
        end = end_time_ms or int(time.time() * 1000)
        self._client.set_terminated(self._run, status=status, end_time=end)

    def suspend(self) -> None:
        """The job was requeued: leave the run RUNNING for the next attempt to continue."""
        self._client.set_tag(self._run, f"{self._attempt_prefix}.end", "requeued")


def open_mlflow_run(
    uri: str, experiment: str, artifact_root: Path, record: RunRecord
) -> MlflowTracker:
    """The run's MLflow run, created or reopened (the store's lock held: a new SQLite store
    gets its tables once); mlflow's import failing is said as such."""
    try:
        with store_lock(uri):
            return MlflowTracker(uri, experiment, artifact_root, record)
    except ImportError as error:
        if let_in():  # mlflow wanted a package this process left out
            raise
        raise HpcDdpError(
            f"tracking.enabled=true but mlflow cannot be imported ({error})",
            "pip install mlflow, or run with tracking.enabled=false",
        ) from None
