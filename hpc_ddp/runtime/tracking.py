"""Experiment tracking from rank 0. MLflow is imported only when a rank-0 run starts it, so the
other ranks never pay its import time (~2.4 s).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from hpc_ddp.runtime.config import TrackingConfig

DEFAULT_DB_NAME = "mlflow.db"
#: MLflow takes at most this many metrics in one call (log_batch).
MAX_METRICS_PER_CALL = 1000


class Tracker(Protocol):
    """What the training loop needs from a tracker."""

    @property
    def run_id(self) -> str | None: ...

    @property
    def status(self) -> str:
        """ "ok", "off", or "failed: <why>" (the run went on without it)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_json_artifact(self, name: str, data: Any) -> None: ...

    def log_text_artifact(self, name: str, text: str) -> None: ...

    def finish(self, status: str) -> None: ...

    def suspend(self) -> None: ...


class LoggedMetrics(NamedTuple):
    """Metrics logged at one step, and when."""

    metrics: Mapping[str, float]
    step: int
    #: Unix time in milliseconds, as MLflow stores it.
    time_ms: int


class StoreTracker(Tracker, Protocol):
    """A tracker that writes to the store itself (what GuardedTracker drives): it also takes
    metrics of several steps in one call."""

    def log_metric_steps(self, logged: Sequence[LoggedMetrics]) -> None: ...


class NullTracker:
    """Ranks other than 0, and runs with tracking.enabled=false."""

    run_id: str | None = None
    status = "off"

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_json_artifact(self, name: str, data: Any) -> None:
        pass

    def log_text_artifact(self, name: str, text: str) -> None:
        pass

    def finish(self, status: str) -> None:
        pass

    def suspend(self) -> None:
        pass


def default_tracking_uri(output_dir: str | Path) -> str:
    """The embedded SQLite store kept beside the runs: no server needed."""
    return f"sqlite:///{Path(output_dir).resolve() / DEFAULT_DB_NAME}"


def git_commit(directory: str | Path = ".") -> str | None:
    """The checked-out commit of the code being run, if it is a git checkout."""
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    commit = result.stdout.strip()
    return commit if result.returncode == 0 and commit else None


@dataclass(frozen=True)
class RunRecord:
    """What rank 0 records in MLflow for this attempt of a run."""

    #: The run's name (MLflow's run name).
    name: str
    params: Mapping[str, Any]
    tags: Mapping[str, str]
    #: The MLflow run a checkpoint names: this attempt continues it.
    resume_run_id: str | None = None
    #: The global step this attempt starts at.
    start_step: int = 0
    #: Names this attempt (host, pid, time): a tracker started again for the same attempt
    #: (after MLflow came back) continues its tags instead of adding an attempt.
    attempt_token: str = ""


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
        self._mlflow = mlflow
        self._client = mlflow.MlflowClient(tracking_uri=tracking_uri)
        resumed = self._reopen(record.resume_run_id) if record.resume_run_id else None
        tags, params, start_step = record.tags, record.params, record.start_step
        if resumed is None:
            experiment_id = self._experiment_id(experiment, artifact_root)
            run = self._client.create_run(
                experiment_id, run_name=record.name, tags={"mlflow.runName": record.name}
            )
            resumed_tags: dict[str, str] = {}
            self._run = str(run.info.run_id)
        else:
            self._run, resumed_tags = resumed
        self.run_id: str | None = self._run
        attempt = sum(1 for key in resumed_tags if key.endswith(".start_step"))
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
                    name, artifact_location=(artifact_root / name).resolve().as_uri()
                )
            )
        except self._mlflow.exceptions.MlflowException:
            # Another job created it between our lookup and create.
            again = self._client.get_experiment_by_name(name)
            if again is None:
                raise
            return str(again.experiment_id)

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

    def finish(self, status: str) -> None:
        """End the run: FINISHED, FAILED or KILLED (stopped and not requeued)."""
        self._client.set_tag(self._run, f"{self._attempt_prefix}.end", status.lower())
        self._client.set_terminated(self._run, status=status)

    def suspend(self) -> None:
        """The job was requeued: leave the run RUNNING for the next attempt to continue."""
        self._client.set_tag(self._run, f"{self._attempt_prefix}.end", "requeued")


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Hold an exclusive lock beside an SQLite store while opening it: two runs that open a
    new store at once would both create its tables, and one would fail in the migration. A
    store in a folder that does not exist is refused (MLflow would create the folders)."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    database = Path(uri.removeprefix("sqlite:///"))
    if not database.parent.is_dir():  # MLflow would create every missing folder, even at /
        raise FileNotFoundError(
            f"the folder {database.parent} of {uri} does not exist: create it or fix tracking.uri"
        )
    with open(database.with_name(database.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def tracking_uri(config: TrackingConfig, output_dir: str | Path) -> str:
    """tracking.uri, else the embedded SQLite store in output_dir."""
    return config.uri or default_tracking_uri(output_dir)


def artifact_root(output_dir: str | Path) -> Path:
    """Where the embedded store's runs keep their artifacts."""
    return Path(output_dir) / "mlartifacts"


def start_tracker(
    config: TrackingConfig, output_dir: str, record: RunRecord, run_dir: Path | None = None
) -> Tracker:
    """An MLflow run (rank 0 only: other ranks use a NullTracker) driven from a child process
    started now (see tracking_worker), the run created or reopened on first use; a failing
    MLflow never stops training (see GuardedTracker). A ``record`` with a ``resume_run_id``
    continues that run. With ``run_dir``, a tracker that failed is tried again now and then:
    the run's record is replayed into MLflow and tracking goes on."""
    if not config.enabled:
        return NullTracker()
    from hpc_ddp.runtime.tracking_guard import GuardedTracker
    from hpc_ddp.runtime.tracking_worker import WorkerTracker, spawn_worker, take_prestarted

    uri = tracking_uri(config, output_dir)
    artifacts = artifact_root(output_dir)
    # Started at the rank's first line where it could be (prestart), else now: its imports
    # overlap the run's start.
    worker = take_prestarted() or spawn_worker()

    def start() -> StoreTracker:
        world_size = int(record.tags.get("hpc_ddp.world_size", "1"))
        return WorkerTracker(uri, config.experiment, artifacts, record, (0, world_size), worker)

    def recover() -> tuple[StoreTracker, set[tuple[str, int]]]:
        from hpc_ddp.view.sync import sync_run

        assert run_dir is not None
        report = sync_run(run_dir, uri, live=True)
        again = dataclasses.replace(record, resume_run_id=report.run_id)
        with store_lock(uri):
            return MlflowTracker(uri, config.experiment, artifacts, again), report.points

    return GuardedTracker(
        start,
        uri,
        recover=recover if run_dir is not None else None,
        retry_s=config.retry_s,
    )


def run_tags(
    launcher: str,
    world_size: int,
    num_nodes: int,
    job_id: str,
    restart_count: int,
    elastic_restarts: int = 0,
) -> dict[str, str]:
    """The tags every run carries, so runs can be found by job id and launch shape."""
    tags = {
        "hpc_ddp.launcher": launcher,
        "hpc_ddp.world_size": str(world_size),
        "hpc_ddp.num_nodes": str(num_nodes),
        "hpc_ddp.job_id": job_id,
        "hpc_ddp.restart_count": str(restart_count),
        "hpc_ddp.elastic_restarts": str(elastic_restarts),
        "hpc_ddp.hostname": socket.gethostname(),
    }
    commit = git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
    return tags
