"""What a checkpoint of a run holds, how every rank takes part in writing it, and how a
resume puts it back: the one place for a checkpoint's contents (the files themselves are
:mod:`hpc_ddp.runtime.checkpoint.files`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from hpc_ddp.runtime.checkpoint.files import (
    FORMAT_VERSION,
    checkpoint_dir,
    save_checkpoint,
    saved_world_size,
)
from hpc_ddp.runtime.checkpoint.state import check_loadable, gathered_rng_states, restore_rng
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.loop.context import RunContext
from hpc_ddp.runtime.loop.intervals import MetricLog
from hpc_ddp.runtime.loop.position import Position
from hpc_ddp.runtime.loop.replicas import diverged_replicas
from hpc_ddp.runtime.loop.streams import StreamStates
from hpc_ddp.runtime.loop.timeline import durations
from hpc_ddp.runtime.place.dist import several_ranks


class Checkpointer:
    """Writes and restores the run's checkpoints on this rank (every rank calls each method:
    they are collectives). ``unwatched``: a context in which the stall watchdog rests."""

    def __init__(
        self,
        context: RunContext,
        position: Position,
        metrics: MetricLog,
        streams: StreamStates,
        unwatched: Callable[[], contextlib.AbstractContextManager[None]],
    ) -> None:
        self.context = context
        self.position = position
        self.metrics = metrics
        self.streams = streams
        self._unwatched = unwatched
        #: Seconds of the last save by phase (replica check, state gather, rank 0's write,
        #: the barrier after it); empty before the first save.
        self.last_save_s: dict[str, float] = {}

    def contents(self, finished: bool = False) -> dict[str, Any]:
        """Everything a resume needs, on rank 0 ({} elsewhere). ``finished``: the run's
        training ended with this checkpoint."""
        context = self.context
        check_loadable("run.state", context.values)
        rng = gathered_rng_states(context.device, context.control_group)
        streams = self.streams.gathered(context.control_group)
        metrics = self.metrics.saved()
        if not context.env.is_main:
            return {}
        return {
            "format": FORMAT_VERSION,
            "objects": context.registry.state_dicts(),
            "values": dict(context.values),
            "streams": streams,
            **self.position.saved(),
            "world_size": context.env.world_size,
            "restart_count": context.env.restart_count,
            "rng": rng,
            "metrics": metrics,
            "mlflow_run_id": context.tracker.run_id,
            "fingerprint": context.fingerprint,
            "finished": finished,
        }

    def save(self, reason: str) -> None:
        """A checkpoint at the current step, unless one was written at it: rank 0 writes, every
        rank waits until the file is in place."""
        self.metrics.publish()
        position = self.position
        if not self.context.config.checkpoint.enabled:
            return
        if position.last_checkpoint_step == position.global_step:
            return
        with self._unwatched():
            self._write(reason)
        position.last_checkpoint_step = position.global_step
        position.last_save_time = time.monotonic()

    def _write(self, reason: str) -> None:
        context, position = self.context, self.position
        phases = {"replica_check": time.perf_counter()}
        self.check_replicas()
        phases["gather_state"] = time.perf_counter()
        state = self.contents(finished=reason == "end of training")
        phases["write"] = time.perf_counter()
        if context.env.is_main:
            path = save_checkpoint(
                state,
                checkpoint_dir(context.run_dir),
                position.global_step,
                context.config.checkpoint.keep_last,
            )
            get_logger().info(
                f"checkpoint ({reason}) step {position.global_step}: {path} "
                f"({time.perf_counter() - phases['write']:.2f} s)"
            )
        phases["barrier"] = time.perf_counter()
        if several_ranks():
            dist.barrier(group=context.control_group)
        self.last_save_s = durations(phases, time.perf_counter())

    def restore(self, saved: dict[str, Any]) -> bool:
        """Continue where ``saved`` left off: position, metric sums, plain values, the
        batches' states and, when it was written by as many ranks, every rank's random
        streams (returns whether it did)."""
        env = self.context.env
        self.position.restore(saved, saved_world_size(saved))
        self.metrics.restore(saved["metrics"])
        self.context.values.update(saved.get("values") or {})
        self.streams.restore(saved.get("streams"))
        if len(saved["rng"]) != env.world_size:
            return False
        restore_rng(saved["rng"][env.rank], self.context.device)
        return True

    def check_replicas(self) -> None:
        """Compare every rank's weights with rank 0's; report the first divergence loudly."""
        context, position = self.context, self.position
        for model in context.models():
            diverged = diverged_replicas(model, context.env.world_size, context.control_group)
            if diverged is None or position.replicas_diverged_at is not None:
                continue
            position.replicas_diverged_at = position.global_step
            if context.env.is_main:
                others = f" and {diverged.ranks - 1} other rank(s)" if diverged.ranks > 1 else ""
                get_logger().error(
                    f"model replicas differ from rank 0's at step {position.global_step}: "
                    f"rank {diverged.first_rank} ({diverged.first_entry}){others}; checkpoints "
                    "hold rank 0's weights. HINT: DDP keeps replicas "
                    "equal only when every rank makes the same update: look for parameters "
                    "or buffers changed outside the optimizer on some ranks only (in-place "
                    "edits, rank-dependent branches, buffers not broadcast)"
                )
