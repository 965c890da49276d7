"""Rank 0's tracker for a run being started: the run's record (its name, parameters, tags and
the MLflow run it continues) and MLflow behind the run's own journal."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from hpc_ddp.runtime import configfile
from hpc_ddp.runtime.checkpoint.files import Found, saved_world_size
from hpc_ddp.runtime.config import RuntimeConfig
from hpc_ddp.runtime.place.plan import LaunchPlan
from hpc_ddp.runtime.tracking.base import (
    RunRecord,
    Tracker,
    artifact_root,
    run_tags,
    tracking_uri,
)
from hpc_ddp.runtime.tracking.factory import start_tracker
from hpc_ddp.runtime.tracking.journal import JournalTracker, read_tracked_run_id
from hpc_ddp.runtime.tracking.membership import read_membership
from hpc_ddp.runtime.tracking.provenance import AttemptCode


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
    record = RunRecord(
        # NAME/ID, as `hpc-ddp runs` shows it: runs of one script are told apart in the UI.
        name=f"{run_name}/{plan.run_dir.name}",
        params={
            **configfile.flatten(settings),
            **(params or {}),
            **(membership.params() if membership else {}),
        },
        tags={
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
    )
    tracker = JournalTracker(
        start_tracker(
            settings.tracking, settings.run.output_dir, record, plan.run_dir, env.world_size
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
