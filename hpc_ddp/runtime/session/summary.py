"""summary.json: the facts of a finished run, written by rank 0."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpc_ddp.runtime.checkpoint.files import write_atomically
from hpc_ddp.runtime.loop.context import RunContext
from hpc_ddp.runtime.loop.replicas import weights_sha256
from hpc_ddp.runtime.session.models import whole_weights
from hpc_ddp.runtime.shards import holds_shards


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
