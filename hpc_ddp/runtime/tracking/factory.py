"""The tracker a run gets: none off rank 0 or with tracking off; else a guarded MLflow run
in a child process, retried in the background after a failure."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hpc_ddp.runtime.config import TrackingConfig
from hpc_ddp.runtime.tracking.base import (
    NullTracker,
    RunRecord,
    StoreTracker,
    Tracker,
    artifact_root,
    store_lock,
    tracking_uri,
)
from hpc_ddp.runtime.tracking.guard import GuardedTracker
from hpc_ddp.runtime.tracking.mlflow_tracker import MlflowTracker
from hpc_ddp.runtime.tracking.sync import sync_run
from hpc_ddp.runtime.tracking.worker import (
    WorkerTracker,
    cpu_seconds,
    spawn_worker,
    take_prestarted,
)


def start_tracker(
    config: TrackingConfig,
    output_dir: str,
    record: RunRecord,
    run_dir: Path | None = None,
    world_size: int = 1,
) -> Tracker:
    """An MLflow run (rank 0 only: other ranks use a NullTracker) driven from a child process
    started now (see tracking_worker), the run created or reopened on first use; a failing
    MLflow never stops training (see GuardedTracker). A ``record`` with a ``resume_run_id``
    continues that run. With ``run_dir``, a tracker that failed is tried again now and then:
    the run's record is replayed into MLflow and tracking goes on. ``world_size``: the
    run's, for the tracking process's log lines."""
    if not config.enabled:
        return NullTracker()
    uri = tracking_uri(config, output_dir)
    artifacts = artifact_root(output_dir)
    # Started at the rank's first line where it could be (prestart), else now: its imports
    # overlap the run's start.
    worker = take_prestarted() or spawn_worker()

    def start() -> StoreTracker:
        return WorkerTracker(uri, config.experiment, artifacts, record, (0, world_size), worker)

    def recover() -> tuple[StoreTracker, set[tuple[str, int]]]:
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
        cpu_seconds=lambda: cpu_seconds(worker.process.pid),
    )
