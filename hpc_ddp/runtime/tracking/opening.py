"""Rank 0's tracker for a run being started: the run's record (its name, parameters, tags and
the MLflow run it continues) and MLflow behind the run's own journal; none off rank 0 or
with tracking off, else a guarded MLflow run in a child process, retried in the background
after a failure."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.runtime import configfile
from hpc_ddp.runtime.checkpoint.files import Found, saved_world_size
from hpc_ddp.runtime.config import RuntimeConfig, TrackingConfig
from hpc_ddp.runtime.place.plan import LaunchPlan
from hpc_ddp.runtime.tracking.base import (
    NullTracker,
    RunRecord,
    StoreTracker,
    Tracker,
    artifact_root,
    run_tags,
    store_lock,
    tracking_uri,
)
from hpc_ddp.runtime.tracking.guard import GuardedTracker
from hpc_ddp.runtime.tracking.journal import JournalTracker
from hpc_ddp.runtime.tracking.membership import read_membership
from hpc_ddp.runtime.tracking.mlflow_tracker import MlflowTracker
from hpc_ddp.runtime.tracking.provenance import AttemptCode
from hpc_ddp.runtime.tracking.record import (
    mlflow_behind,
    read_status,
    read_tags_set,
    read_tracked_run_id,
)
from hpc_ddp.runtime.tracking.sync import sync_run
from hpc_ddp.runtime.tracking.worker import (
    WorkerTracker,
    cpu_seconds,
    spawn_worker,
    take_prestarted,
)


def open_tracker(
    settings: RuntimeConfig,
    plan: LaunchPlan,
    run_name: str,
    params: Mapping[str, Any] | None,
    resume: Found | None,
    progress: Callable[[], tuple[int, int]],
    began_at: Callable[[], int],
    entry_unix: float,
    code: AttemptCode | None,
) -> Tracker:
    """Rank 0's tracker: MLflow (in the background) behind the run's own record;
    ``progress`` gives the run's (global step, epoch) now, ``began_at`` the step it resumed
    from (0 for a new run)."""
    env = plan.dist_env
    saved = resume[1] if resume else None
    membership = read_membership(plan.run_dir)
    previous = read_status(plan.run_dir)  # before this attempt's journal rewrites it
    record = RunRecord(
        # NAME/ID, as `hpc-ddp runs` shows it: runs of one script are told apart in the UI.
        name=f"{run_name}/{plan.run_dir.name}",
        params={
            **configfile.flatten(settings),
            **(params or {}),
            **(membership.params() if membership else {}),
        },
        tags={
            # Set by earlier attempts (an idle GPU), perhaps while MLflow was away: sent
            # again whenever MLflow opens the run.
            **read_tags_set(plan.run_dir),
            **run_tags(
                env.launcher,
                env.world_size,
                env.num_nodes,
                env.job_id,
                env.restart_count,
                env.elastic_restarts,
                saved_world_size(saved) if saved else None,
            ),
            **(membership.tags() if membership else {}),
            **(code.tags() if code else {}),
        },
        # One MLflow run per run id: the checkpoint's, else the one tracking.json names (a
        # checkpoint written while MLflow was still starting names none; a run stopped
        # before its first checkpoint has none).
        resume_run_id=(
            (saved.get("mlflow_run_id") if saved else None) or read_tracked_run_id(plan.run_dir)
        ),
        start_step=int(saved["global_step"]) if saved else 0,
        attempt_token=f"{env.hostname}:{os.getpid()}:{entry_unix:.0f}",
        start_time_ms=int(entry_unix * 1000),
        earlier_attempts=int((previous or {}).get("attempts", 0)),
    )
    tracker = JournalTracker(
        start_tracker(
            settings.tracking,
            settings.run.output_dir,
            record,
            plan.run_dir,
            env.world_size,
            behind=mlflow_behind(previous),
        ),
        plan.run_dir,
        progress,
        env.job_id,
        env.world_size,
        tracking_record(settings, record),
        began_at=began_at,
    )
    for name, text in (code.artifacts() if code else {}).items():
        tracker.log_text_artifact(name, text)
    return tracker


def tracking_record(settings: RuntimeConfig, record: RunRecord) -> dict[str, Any] | None:
    """What tracking.json keeps for `hpc-ddp tracking sync` (None: tracking is off)."""
    if not settings.tracking.enabled:
        return None
    return {
        "uri": tracking_uri(settings.tracking, settings.run.output_dir),
        "experiment": settings.tracking.experiment,
        "artifact_root": str(artifact_root(settings.run.output_dir).resolve()),
        "run_name": record.name,
        "params": {key: str(value) for key, value in record.params.items()},
        "tags": dict(record.tags),
        "run_id": record.resume_run_id,
    }


def start_tracker(
    config: TrackingConfig,
    output_dir: str,
    record: RunRecord,
    run_dir: Path | None = None,
    world_size: int = 1,
    behind: bool = False,
) -> Tracker:
    """An MLflow run (rank 0 only: other ranks use a NullTracker) driven from a child process
    started now (see tracking_worker), the run created or reopened on first use; a failing
    MLflow never stops training (see GuardedTracker). A ``record`` with a ``resume_run_id``
    continues that run. With ``run_dir``, a tracker that failed is tried again now and then:
    the run's record is replayed into MLflow and tracking goes on. ``world_size``: the
    run's, for the tracking process's log lines. ``behind``: the attempts before may have left
    points out of MLflow (tracking.record.mlflow_behind): the tracking process replays
    them from ``run_dir``'s record before it tracks, as it does where it makes a new MLflow
    run for a run that had attempts before."""
    if not config.enabled:
        return NullTracker()
    uri = tracking_uri(config, output_dir)
    artifacts = artifact_root(output_dir)
    # Started at the rank's first line where it could be (prestart), else now: its imports
    # overlap the run's start.
    worker = take_prestarted() or spawn_worker()

    def start() -> StoreTracker:
        return WorkerTracker(
            uri,
            config.experiment,
            artifacts,
            record,
            (0, world_size),
            worker,
            catch_up=run_dir,
            behind=behind,
        )

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
