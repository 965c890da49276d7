"""How a run ends well: the final checkpoint, summary.json and MLflow FINISHED; and a run
started again after it had finished, left as it was."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from hpc_ddp.runtime.checkpoint.loading import Resumed
from hpc_ddp.runtime.errors import AlreadyFinished
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.loop.context import RunContext
from hpc_ddp.runtime.monitor.timeline import durations, process_resources, rank_spread
from hpc_ddp.runtime.preempt.lost_rank import withdraw_handoff
from hpc_ddp.runtime.preempt.progress import forget_attempt
from hpc_ddp.runtime.session.ending import Ending
from hpc_ddp.runtime.session.summary import run_facts, write_summary
from hpc_ddp.runtime.tracking.journal import JournalTracker


def finish_run(
    context: RunContext,
    finish_training: Callable[[], Mapping[str, Any]],
    ending: Ending,
    started: float,
    timeline: dict[str, float],
    summary: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The end of :meth:`hpc_ddp.Run.finish` (see there); the summary on every rank.
    ``finish_training``: the final checkpoint, returning what the loop says of the run."""
    context.times.begin_ending("end")
    phases = {"final_checkpoint": time.perf_counter()}
    loop_facts = finish_training()
    phases["summary"] = time.perf_counter()
    if loop_facts["first_step_unix"] is not None:
        timeline.setdefault("first_step_unix", loop_facts["first_step_unix"])
    spread = rank_spread(timeline, context.control_group)
    facts = {
        **run_facts(context, loop_facts, started, timeline),
        "timeline_ranks": spread,
        **process_resources(),
        **(summary or {}),
    }
    is_main = context.env.is_main
    if is_main:
        path = _write_summary(context, facts)
        context.tracker.log_json_artifact("summary.json", facts)
        if path is not None:
            facts["summary_path"] = str(path)
            get_logger().info(f"summary: {path}")
    phases["close"] = time.perf_counter()
    ending("FINISHED")
    facts["ending_s"] = durations(phases, time.perf_counter())
    if ending.account is not None:  # over every attempt, this one's end included
        facts["time_account"] = dict(ending.account)
    # Known now even if MLflow was still starting when the summary was first written; its
    # status may have changed at the very end.
    facts["mlflow_run_id"] = context.tracker.run_id
    facts["tracking"] = context.tracker.status
    if is_main:
        get_logger().info(
            "run ended: "
            + ", ".join(f"{phase} {s:.2f} s" for phase, s in facts["ending_s"].items())
        )
        # Again, now with the end's own times (and MLflow's final state).
        if "summary_path" in facts:
            _write_summary(context, {k: v for k, v in facts.items() if k != "summary_path"})
    return facts


def _write_summary(context: RunContext, facts: dict[str, Any]) -> Path | None:
    """summary.json, or one warning when the file system refuses it (a full disk at the very
    end): the run's training, checkpoint and end are whole without it."""
    try:
        return write_summary(context.run_dir, facts)
    except OSError as error:
        get_logger().warning(
            f"cannot write {context.run_dir / 'summary.json'} ({error.strerror or error}); "
            "the run finished and its final checkpoint and metrics.jsonl are kept. HINT: "
            "free space there; the MLflow run holds the summary when tracking is on"
        )
        return None


def end_already_finished(context: RunContext, ending: Ending, resumed: Resumed) -> NoReturn:
    """The run finished before and nothing is left to train: leave its files alone."""
    if context.env.is_main:
        withdraw_handoff(context.environ)
        forget_attempt(context.run_dir, context.attempt_id)
        if isinstance(context.tracker, JournalTracker):
            context.tracker.restore_previous()
        get_logger().warning(
            f"run {context.run_dir} already finished at step {resumed.step}; nothing "
            "to train, its summary.json and checkpoints are kept as they were. HINT: "
            "train more epochs to continue it, or give a new run another run.id"
        )
    ending(None)  # no status: its MLflow run stays as it ended
    raise AlreadyFinished(resumed.step, str(context.run_dir))
