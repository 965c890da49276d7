"""How a run ends well: the final checkpoint, summary.json (the facts of a finished run,
written by rank 0) and MLflow FINISHED; and a run started again after it had finished, left
as it was."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from hpc_ddp.runtime.checkpoint.files import write_atomically
from hpc_ddp.runtime.checkpoint.loading import Resumed
from hpc_ddp.runtime.errors import AlreadyFinished
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.loop.context import RunContext
from hpc_ddp.runtime.loop.replicas import weights_sha256
from hpc_ddp.runtime.monitor.throughput import run_tokens_per_s
from hpc_ddp.runtime.monitor.timeline import durations, process_resources, rank_spread
from hpc_ddp.runtime.preempt.lost_rank import withdraw_handoff
from hpc_ddp.runtime.preempt.progress import forget_attempt
from hpc_ddp.runtime.session.ending import Ending
from hpc_ddp.runtime.session.models import whole_weights
from hpc_ddp.runtime.shards import holds_shards
from hpc_ddp.runtime.tracking.journal import JournalTracker


def run_facts(
    context: RunContext,
    loop_facts: Mapping[str, Any],
    started: float,
    timeline: dict[str, float],
) -> dict[str, Any]:
    """Where and how the run trained, identical on every rank but for timings
    (``loop_facts``: what the loop says of where it ended)."""
    env = context.env
    models = context.models()
    return {
        "world_size": env.world_size,
        "num_nodes": env.num_nodes,
        "launcher": env.launcher,
        "job_id": env.job_id,
        "run_id": context.run_dir.name,
        "restart_count": env.restart_count,
        "elastic_restarts": env.elastic_restarts,
        "stopped_early": False,
        "device": str(context.device),
        "backend": context.plan.device.backend,
        **loop_facts,
        "tokens_per_s": run_tokens_per_s(
            loop_facts.get("samples_seen"),
            loop_facts.get("train_time_s", 0.0),
            context.config.monitor.tokens_per_sample,
        ),
        "wall_time_s": round(time.perf_counter() - started, 3),
        "weights_sha256": _weights_sha256(context, models),
        "torch_threads": torch.get_num_threads(),
        "mlflow_run_id": context.tracker.run_id,
        "tracking": context.tracker.status,
        "timeline": dict(timeline),
        "gpu_peak_memory_gb": _gpu_peak_memory_gb(context.device),
    }


def _gpu_peak_memory_gb(device: torch.device) -> float | None:
    """The most GPU memory this rank's tensors held at once (None on a CPU)."""
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 3)


def _weights_sha256(context: RunContext, models: list[nn.Module]) -> str | None:
    """The one trained model's fingerprint (None with several); of a sharded model, its
    whole weights gathered on rank 0 (a collective; None on the other ranks)."""
    if len(models) != 1:
        return None
    whole = whole_weights(context, models[0])
    if holds_shards(models[0]) and not context.env.is_main:
        return None  # gathered on rank 0 only
    return weights_sha256(whole)


def strict_json(value: Any) -> Any:
    """``value`` with NaN and infinities as null: strict JSON has neither (a metric over an
    empty set is NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(item) for item in value]
    return value


def write_summary(run_dir: Path, facts: dict[str, Any]) -> Path:
    """<run dir>/summary.json, replaced atomically so a reader never sees half of it."""
    text = json.dumps(strict_json(facts), indent=2, sort_keys=True, default=str) + "\n"
    return write_atomically(run_dir / "summary.json", lambda handle: handle.write(text.encode()))


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
