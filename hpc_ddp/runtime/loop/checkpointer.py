"""What a checkpoint of a run holds, how every rank takes part in writing it, and how a
resume puts it back: the one place for a checkpoint's contents (the files themselves are
:mod:`hpc_ddp.runtime.checkpoint.files`, which one a run resumes from
:mod:`hpc_ddp.runtime.checkpoint.loading`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from hpc_ddp.runtime.checkpoint.buffers import own_buffers, restore_own_buffers
from hpc_ddp.runtime.checkpoint.files import (
    FORMAT_VERSION,
    Found,
    checkpoint_dir,
    save_checkpoint,
    saved_world_size,
)
from hpc_ddp.runtime.checkpoint.loading import Resumed, restore_registered
from hpc_ddp.runtime.checkpoint.objects import object_kinds, plain_states, tensor_states
from hpc_ddp.runtime.checkpoint.room import check_room
from hpc_ddp.runtime.checkpoint.sharded.layout import FOLDER_FORMAT, folder_state
from hpc_ddp.runtime.checkpoint.sharded.metadata import forget_metadata
from hpc_ddp.runtime.checkpoint.state import (
    check_loadable,
    restore_rng,
    rng_state,
)
from hpc_ddp.runtime.checkpoint.unregistered import RegistrationWatch
from hpc_ddp.runtime.checkpoint.writer import FolderSaves
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.loop.context import RunContext
from hpc_ddp.runtime.loop.data import seed_rank_streams
from hpc_ddp.runtime.loop.intervals import MetricLog
from hpc_ddp.runtime.loop.position import Position
from hpc_ddp.runtime.loop.replicas import diverged_replicas, divergence_message
from hpc_ddp.runtime.loop.streams import StreamStates
from hpc_ddp.runtime.monitor.timeline import durations
from hpc_ddp.runtime.place.dist import (
    gather_object_to_main,
    several_ranks,
)
from hpc_ddp.runtime.shards import holds_shards

#: Saves that may be written in the background: training goes on after them.
_BACKGROUND_REASONS = ("periodic", "requested")


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
        self.folders = FolderSaves(
            checkpoint_dir(context.run_dir),
            context.config.checkpoint.keep_last,
            context.checkpoint_group or context.control_group,
            context.env.is_main,
            measure_room_once=context.config.checks.enabled,
        )
        self._budget_said = False
        self._registrations = registration_watch(context)
        #: Seconds of the last save by phase (replica check, state gather, rank 0's write,
        #: the barrier after it); empty before the first save.
        self.last_save_s: dict[str, float] = {}

    def contents(self, finished: bool = False) -> dict[str, Any]:
        """Everything a resume needs, on rank 0 ({} elsewhere). ``finished``: the run's
        training ended with this checkpoint."""
        context = self.context
        check_loadable("run.state", context.values)
        every = gather_object_to_main(own_state(context, self.streams), context.control_group)
        metrics = self.metrics.saved()
        if not context.env.is_main:
            return {}
        has_streams = any(own["streams"] is not None for own in every)
        return {
            "format": FORMAT_VERSION,
            "objects": context.registry.state_dicts(),
            **{key: [own[key] for own in every] for key in ("rng", "per_rank", "buffers")},
            "streams": [own["streams"] for own in every] if has_streams else None,
            **run_state(context, self.position, metrics, finished),
        }

    def folder_contents(self, finished: bool = False) -> dict[str, Any]:
        """What this rank hands a folder save (see :mod:`hpc_ddp.runtime.checkpoint.sharded`):
        the registered objects' tensors, its own random streams, batch state and objects
        registered per rank and, on rank 0, the run's state."""
        context = self.context
        check_loadable("run.state", context.values)
        registry = context.registry
        kinds = object_kinds(registry.objects)
        own = own_state(context, self.streams)
        metrics = self.metrics.saved()
        run = None
        if context.env.is_main:
            run = {
                "format": FOLDER_FORMAT,
                "kinds": kinds,
                "plain": plain_states(registry.objects, kinds),
                "has_streams": own["streams"] is not None,
                **run_state(context, self.position, metrics, finished),
            }
        tensors = tensor_states(registry.objects, kinds, registry.wrappers)
        return folder_state(tensors, run, context.env.rank, own)

    def save(self, reason: str) -> None:
        """A checkpoint at the current step, unless one was written at it (every rank calls
        it). Periodic and requested saves may go on in the background (checkpoint.save_mode
        async); a stop or the end returns once every earlier save is on disk."""
        self.metrics.publish()
        position = self.position
        if not self.context.config.checkpoint.enabled:
            return
        if position.last_checkpoint_step == position.global_step:
            if reason not in _BACKGROUND_REASONS:
                with self.context.times.counting("checkpoint"):  # an async save's end
                    self.folders.wait()
            return
        with self._unwatched(), self.context.times.counting("checkpoint"):
            self._write(reason)
        position.last_checkpoint_step = position.global_step
        position.last_save_time = time.monotonic()

    def wait(self) -> None:
        """Until a checkpoint being written in the background is on disk."""
        self.folders.wait()

    def _write(self, reason: str) -> None:
        context, position = self.context, self.position
        phases = {"replica_check": time.perf_counter()}
        self._registrations.check_ranks_alike()
        check_replicas(context, position)
        mode = context.config.checkpoint.save_mode
        if mode != "single_file":
            phases["gather_state"] = time.perf_counter()
            state = self.folder_contents(finished=reason == "end of training")
            phases["write"] = time.perf_counter()
            background = mode == "async" and reason in _BACKGROUND_REASONS
            self.folders.write(state, position.global_step, reason, background)
            self.last_save_s = durations(phases, time.perf_counter())
            self._check_budget()
            return
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

    def _check_budget(self) -> None:
        """Name, once, a save that takes longer than the stop signal's warning."""
        took, warning = self.folders.last_write_s, self.context.config.preempt.warning_s
        if self._budget_said or took is None or not self.context.env.is_main:
            return
        self._budget_said = True
        if took > warning:
            get_logger().warning(over_budget(took, warning))

    def resume(self, found: Found | None) -> Resumed | None:
        """Before training: put ``found`` back (the registered objects, the position, the
        metric sums, the plain values, the batches' states and, when as many ranks wrote it,
        every rank's random streams and DDP buffers), or seed each rank's own streams; refuse
        a registered object whose state a resume could not load, and warn when nothing is."""
        context = self.context
        resumed, streams_restored = None, False
        if found is not None:
            with context.times.counting("resume"):
                resumed, streams_restored = self._load(found)
        if context.config.checkpoint.enabled:
            context.registry.check_loadable()
            if context.config.checks.enabled:
                keep_last = context.config.checkpoint.keep_last
                check_room(context.run_dir, context.registry.objects, keep_last,
                           context.env.is_main, context.control_group)  # fmt: skip
        if not streams_restored:
            seed_rank_streams(context.config.run.seed, context.env.rank, self.position.global_step)
        if context.config.checkpoint.enabled:
            self._registrations.start()  # what a resume would miss, said on rank 0
        return resumed

    def close(self) -> None:
        """Stop checking the optimizers' steps (the run ended)."""
        self._registrations.close()

    def _load(self, found: Found) -> tuple[Resumed, bool]:
        """``found`` put back; also whether its random streams fitted this world size."""
        (path, saved), env, registry = found, self.context.env, self.context.registry
        written_by = saved_world_size(saved)
        registry.restore_per_rank(saved, path, written_by, env.rank, env.world_size)
        restore_registered(registry, saved["objects"], path)
        forget_metadata()
        self.position.restore(saved, written_by)
        self.metrics.restore(saved["metrics"])
        self.context.values.update(saved.get("values") or {})
        self.streams.restore(saved.get("streams"), written_by)
        streams_fit = len(saved["rng"]) == env.world_size
        if streams_fit:
            restore_rng(saved["rng"][env.rank], self.context.device)
            restore_own_buffers(registry.wrappers, saved.get("buffers"), env.rank)
        resumed = Resumed(path, self.position.global_step, written_by, bool(saved.get("finished")))
        if env.is_main:  # every rank resumes from the same checkpoint: said once
            say_resumed(resumed, self.position, env.world_size, streams_fit)
        return resumed, streams_fit


def registration_watch(context: RunContext) -> RegistrationWatch:
    """What a resume would get wrong: rank 0 says it; every rank takes part in a save's
    check of the ranks' registrations and ``run.state``."""
    say = get_logger().warning if context.env.is_main else None
    return RegistrationWatch(
        context.registry, context.values, context.wrapped, context.control_group, say
    )


def check_replicas(context: RunContext, position: Position) -> None:
    """Compare every rank's weights with rank 0's; report the first divergence loudly."""
    for model in context.models():
        if holds_shards(model):
            continue  # each rank holds its own shard: there are no replicas
        diverged = diverged_replicas(model, context.env.world_size, context.control_group)
        if diverged is None or position.replicas_diverged_at is not None:
            continue
        position.replicas_diverged_at = position.global_step
        if context.env.is_main:
            get_logger().error(divergence_message(diverged, position.global_step))


def own_state(context: RunContext, streams: StreamStates) -> dict[str, Any]:
    """This rank's own part of a checkpoint: its random streams, its batch state and its
    objects registered per rank."""
    return {
        "rng": rng_state(context.device),
        "streams": streams.own_state(),
        "per_rank": context.registry.per_rank_states(),
        "buffers": own_buffers(context.registry.wrappers),
    }


def run_state(
    context: RunContext, position: Position, metrics: Any, finished: bool
) -> dict[str, Any]:
    """What both formats keep of the run itself (rank 0's)."""
    return {
        "per_rank_names": sorted(context.registry.per_rank),
        "values": dict(context.values),
        **position.saved(),
        "world_size": context.env.world_size,
        "restart_count": context.env.restart_count,
        "metrics": metrics,
        "mlflow_run_id": context.tracker.run_id,
        "fingerprint": context.fingerprint,
        "finished": finished,
    }


def say_resumed(resumed: Resumed, position: Position, world_size: int, streams_fit: bool) -> None:
    """Rank 0's lines on a resume: where it goes on, and what a changed world size loses."""
    get_logger().info(
        f"resumed from {resumed.path} at step {position.global_step} (epoch {position.epoch}, "
        f"step {position.step_in_epoch} of the epoch)"
    )
    if not streams_fit:
        get_logger().warning(
            f"the world size changed: the checkpoint was written by {resumed.world_size} "
            f"ranks, this run has {world_size}. With run.train_loader the global batch, the "
            "order of the samples and the metric sums go on exactly; a loader of the "
            "script's own keeps its batch per rank, so its global batch and the steps of "
            "an epoch change with the number of ranks. Each rank's own random streams "
            "(dropout, augmentation in the main process) cannot go on, and are seeded anew "
            "from (run.seed, rank, step), so such a run is not bitwise the one it continues"
        )


def over_budget(took_s: float, warning_s: float) -> str:
    """What a save that took ``took_s`` seconds, longer than the ``warning_s`` between the
    stop signal and the kill, means and what to do."""
    return (
        f"a checkpoint took {took_s:.0f} s, longer than the {warning_s:.0f} s between the "
        "stop signal and the kill (preempt.warning_s): a stop would be killed before its "
        "checkpoint is on disk. HINT: warn earlier (#SBATCH --signal=USR1@300 and "
        "preempt.warning_s=300), save less (fewer registered objects), or write to a faster "
        "file system (run.output_dir)"
    )
