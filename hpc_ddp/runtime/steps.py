"""The step boundary: what happens between one optimizer step and the next.

:class:`StepLoop` counts steps over a loader's micro-batches and, at step boundaries only,
does what a run needs: interval metrics (:mod:`hpc_ddp.runtime.intervals`), the agreed
stop (every rank stops after the SAME step, then checkpoints and maybe requeues), periodic
checkpoints by steps or minutes, and exact epoch sums. Nothing in it synchronises the
device per step; the stop agreement is a CPU (gloo) all-reduce overlapped with the next step.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hpc_ddp.runtime.checkpoint import (
    FORMAT_VERSION,
    checkpoint_dir,
    save_checkpoint,
    saved_world_size,
)
from hpc_ddp.runtime.context import RunContext
from hpc_ddp.runtime.dist import broadcast_object, gather_object_to_main, several_ranks
from hpc_ddp.runtime.errors import Stopped
from hpc_ddp.runtime.intervals import MetricLog
from hpc_ddp.runtime.logs import Progress, get_logger
from hpc_ddp.runtime.replicas import diverged_replicas
from hpc_ddp.runtime.requeue import requeue_job
from hpc_ddp.runtime.signals import StepAgreement
from hpc_ddp.runtime.state import check_loadable, gathered_rng_states, restore_rng
from hpc_ddp.runtime.streams import BatchStream, batch_length
from hpc_ddp.runtime.timeline import durations
from hpc_ddp.runtime.watchdog import StallWatchdog

#: The stop-signal check period the automatic setting aims at, and its upper bound in steps.
CHECK_PERIOD_S = 1.0
CHECK_EVERY_MAX = 1000
#: With log_interval=None: the first log step, then the period aimed at and its bound.
FIRST_LOG_INTERVAL = 20
LOG_PERIOD_S = 5.0
LOG_INTERVAL_MAX = 10000

_END = object()


@dataclass
class Position:
    """Where the run is; what a checkpoint records."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    train_time_s: float = 0.0
    resumed_from_step: int | None = None
    #: The world size of the checkpoint resumed from (None: a fresh run).
    resumed_from_world_size: int | None = None
    stopped: bool = False
    last_checkpoint_step: int = -1
    last_save_time: float = field(default_factory=time.monotonic)
    #: Wall-clock time (Unix) of this process's first finished optimizer step.
    first_step_unix: float | None = None
    #: The first step after which some rank's weights differed from rank 0's (None: never).
    replicas_diverged_at: int | None = None


class StepLoop:
    """Epochs and steps of one run on this rank (see the module docstring)."""

    def __init__(self, context: RunContext, log_interval: int | None) -> None:
        self.context = context
        self.position = Position()
        self.metrics = MetricLog(context)
        self.num_epochs: int | None = None
        self.max_steps: int | None = None
        self.accumulating = False
        #: Set while :meth:`hpc_ddp.Run.epochs` drives the epochs; without it, every
        #: :meth:`steps` is an epoch of its own.
        self.in_epochs = False
        #: Set when :meth:`hpc_ddp.Run.epochs` ran to its end.
        self.completed = False
        #: Seconds of the last checkpoint save by phase (replica check, state gather, rank 0's
        #: write, the barrier after it); empty before the first save.
        self.last_save_s: dict[str, float] = {}
        preempt = context.config.preempt
        self.check_every = preempt.check_every_steps or 1
        self.log_interval = log_interval or FIRST_LOG_INTERVAL
        self._calibrated = preempt.check_every_steps is not None and log_interval is not None
        self._interval_steps = 0
        self._interval_started = time.perf_counter()
        self._agreement: StepAgreement | None = None
        self._watchdog: StallWatchdog | None = None
        self._begun = False
        #: The user's own iterable being stepped through (None: a TrainLoader, or none yet).
        self._stream: BatchStream | None = None
        #: Each rank's stream state from the checkpoint resumed from, until a stream takes it.
        self._saved_streams: list[Any] | None = None
        self._stream_said = False
        #: The micro-batch index within the optimizer step being handed out.
        self._micro = 0
        self._save_requested = False
        self._unwatched_by_user = False
        self._stepping = False

    # -- epochs and steps ---------------------------------------------------------------------

    def begin(self, before_first_step: Callable[[], object]) -> None:
        """Once, before the first step: ``before_first_step`` (the resume), the stop
        agreement, and the garbage collector told that everything alive now stays."""
        if self._begun:
            return
        self._begun = True
        before_first_step()
        several = self.context.env.world_size > 1
        self._agreement = StepAgreement(self.context.control_group if several else None)
        self.metrics.progress = Progress(self.max_steps, enabled=self.context.env.is_main)
        self._watchdog = self._start_watchdog()
        gc.freeze()

    def _start_watchdog(self) -> StallWatchdog | None:
        context, dist_config = self.context, self.context.config.dist
        if dist_config.stall_timeout_s is None:
            return None

        def where() -> str:
            position = self.position
            return (
                f"epoch {position.epoch}, step {position.global_step + 1} of the run "
                f"({position.step_in_epoch + 1} of the epoch)"
            )

        return StallWatchdog(
            dist_config.stall_timeout_s,
            dist_config.timeout_s,
            context.env.rank,
            where,
            lambda: context.tracker.finish("FAILED"),
        )

    def more_epochs(self) -> bool:
        """Whether :meth:`hpc_ddp.Run.epochs` goes on (a resumed epoch part-way always does)."""
        position = self.position
        if position.step_in_epoch > 0:
            return True
        if self.num_epochs is not None and position.epoch >= self.num_epochs:
            return False
        return self.max_steps is None or position.global_step < self.max_steps

    def next_epoch(self) -> None:
        self.position.epoch += 1
        self.position.step_in_epoch = 0

    def _total_steps(self, steps_per_epoch: int | None) -> int | None:
        limits = [self.max_steps]
        if self.num_epochs is not None and steps_per_epoch is not None:
            limits.append(self.num_epochs * steps_per_epoch)
        known = [limit for limit in limits if limit is not None]
        return min(known) if known else None

    def steps(self, loader: Any) -> Iterator[Any]:
        """The rest of the current epoch's micro-batches (see :meth:`hpc_ddp.Run.steps`):
        ``loader`` is a TrainLoader or a :class:`BatchStream` over the user's iterable."""
        position = self.position
        accum = loader.grad_accum_steps
        if isinstance(loader, BatchStream):
            self._take_stream(loader)
        else:
            self.metrics.global_batch_size = loader.global_batch_size
        total = self._total_steps(loader.steps_per_epoch)
        self.metrics.progress.total_steps = total
        left: float = float("inf")
        if loader.steps_per_epoch is not None:
            left = loader.steps_per_epoch - position.step_in_epoch
        if total is not None:
            left = min(left, total - position.global_step)
        loader.set_position(position.epoch, position.step_in_epoch)
        started = self._interval_started = time.perf_counter()
        self._interval_steps = 0
        self._micro = 0
        watchdog = self._watchdog
        if watchdog is not None:
            watchdog.arm()
        self._stepping = True
        try:
            batches = iter(loader) if left > 0 else iter(())
            while left > 0:
                batch = next(batches, _END)
                if batch is _END:
                    break
                if not self.metrics.global_batch_size:
                    self._measure_batch(batch, accum)
                self.accumulating = self._micro < accum - 1
                yield batch
                if watchdog is not None:
                    if self._unwatched_by_user:
                        self._unwatched_by_user = False
                        watchdog.arm()
                    watchdog.beat()
                self._micro += 1
                if self._micro < accum:
                    continue
                self._micro = 0
                left -= 1
                self._after_step()
        finally:
            self._stepping = False
            if watchdog is not None:
                watchdog.disarm()
            self.accumulating = False
            self._unwatched_by_user = False
            if self.context.device.type == "cuda":
                torch.cuda.synchronize(self.context.device)  # the epoch's kernels count too
            position.train_time_s += time.perf_counter() - started
        self.metrics.end_epoch(position.epoch)
        if not self.in_epochs:
            self.next_epoch()

    def _take_stream(self, stream: BatchStream) -> None:
        """Step through a user's iterable: load its saved state, say once how it resumes."""
        self._stream = stream
        context, saved = self.context, self._saved_streams
        if saved is not None and stream.stateful:
            self._saved_streams = None
            if len(saved) == context.env.world_size:
                stream.load_state_dict(saved[context.env.rank])
            elif context.env.is_main:
                get_logger().warning(
                    f"the checkpoint holds the batches' state of {len(saved)} ranks, this run "
                    f"has {context.env.world_size}: each rank's {type(stream.batches).__name__} "
                    "starts from its own beginning, not where the run stopped"
                )
        resumed = self.position.resumed_from_step
        if resumed and not self._stream_said and context.env.is_main:
            self._stream_said = True
            get_logger().info(f"resuming the batches at step {resumed}: {stream.kind}")

    def _measure_batch(self, batch: Any, accum: int) -> None:
        """The global batch of a user's iterable, from its first micro-batch (for samples/s
        and the summary's samples_seen)."""
        size = batch_length(batch)
        if size is not None:
            self.metrics.global_batch_size = size * accum * self.context.env.world_size

    # -- at step boundaries, on the user's terms ---------------------------------------------

    def every(self, steps: int) -> bool:
        """Whether the optimizer step about to be taken is one of every ``steps`` (its index,
        the steps done so far, divides by ``steps``), once per step whatever the
        accumulation. When it is, the stall watchdog rests until the next micro-batch."""
        due = self.position.global_step % steps == 0 and self._micro == 0
        if due and self._watchdog is not None and self._watchdog.armed:
            self._watchdog.disarm()
            self._unwatched_by_user = True
        return due

    def request_save(self) -> None:
        """A checkpoint at the end of the optimizer step in progress (every rank asks), or at
        once between steps."""
        if self._stepping:
            self._save_requested = True
        else:
            self.save("requested")

    def _after_step(self) -> None:
        position = self.position
        if position.first_step_unix is None:
            position.first_step_unix = time.time()
        position.global_step += 1
        position.step_in_epoch += 1
        self._interval_steps += 1
        if position.global_step % self.log_interval == 0:
            self._close_interval()
        stop, save_now = False, False
        if position.global_step % self.check_every == 0 and self._agreement is not None:
            stop, save_now = self._agreement.exchange(
                self.context.signals.requested, self._save_due_by_time()
            )
        if stop:
            self._stop()
        every_steps = self.context.config.checkpoint.every_steps
        requested, self._save_requested = self._save_requested, False
        if save_now or requested or (every_steps and position.global_step % every_steps == 0):
            self.save("requested" if requested else "periodic")

    def _save_due_by_time(self) -> bool:
        minutes = self.context.config.checkpoint.every_minutes
        if minutes is None or not self.context.env.is_main:
            return False
        return time.monotonic() - self.position.last_save_time >= minutes * 60

    def _close_interval(self) -> None:
        now = time.perf_counter()
        if not self._calibrated:
            self._calibrate_periods(now - self._interval_started)
        position = self.position
        seconds = now - self._interval_started
        self.metrics.close_interval(
            position.global_step, position.epoch, self._interval_steps, seconds
        )
        self._interval_started, self._interval_steps = now, 0

    def _calibrate_periods(self, elapsed_s: float) -> None:
        """Agree the periods left automatic: stop-signal checks about once per second and
        log steps about every LOG_PERIOD_S seconds of training.

        Rank 0's measured step rate decides and is broadcast, so every rank checks and logs at
        the same steps (both are collectives)."""
        steps_per_s = self._interval_steps / max(1e-9, elapsed_s)

        def steps_for(seconds: float, most: int) -> int:
            return max(1, min(most, round(steps_per_s * seconds)))

        context = self.context
        periods = (
            context.config.preempt.check_every_steps or steps_for(CHECK_PERIOD_S, CHECK_EVERY_MAX),
            context.log_interval or steps_for(LOG_PERIOD_S, LOG_INTERVAL_MAX),
        )
        self.check_every, self.log_interval = broadcast_object(periods, context.control_group)
        self._calibrated = True
        if context.env.is_main:
            get_logger().info(
                f"stop signals are checked every {self.check_every} step(s); progress and "
                f"interval metrics every {self.log_interval} step(s)"
            )

    # -- checkpoints -------------------------------------------------------------------------

    def checkpoint_state(self, finished: bool = False) -> dict[str, Any]:
        """Everything a resume needs (collective: every rank calls it, rank 0 writes it).
        ``finished``: the run's training ended with this checkpoint."""
        context, position = self.context, self.position
        check_loadable("run.state", context.values)
        rng = gathered_rng_states(context.device, context.control_group)
        stream = self._stream
        streams = None
        if stream is not None and stream.stateful:
            mine = stream.state_dict()
            check_loadable(f"the batches' {type(stream.batches).__name__}", mine)
            streams = gather_object_to_main(mine, context.control_group)
        metrics = self.metrics.saved()
        if not context.env.is_main:
            return {}
        return {
            "format": FORMAT_VERSION,
            "objects": context.registry.state_dicts(),
            "values": dict(context.values),
            "streams": streams,
            "epoch": position.epoch,
            "step_in_epoch": position.step_in_epoch,
            "global_step": position.global_step,
            "train_time_s": position.train_time_s,
            "world_size": context.env.world_size,
            "restart_count": context.env.restart_count,
            "rng": rng,
            "metrics": metrics,
            "mlflow_run_id": context.tracker.run_id,
            "fingerprint": context.fingerprint,
            "finished": finished,
        }

    def save(self, reason: str) -> None:
        """Rank 0 writes; all ranks wait until the file is in place."""
        self.metrics.publish()
        position, context = self.position, self.context
        if not context.config.checkpoint.enabled or position.last_checkpoint_step == (
            position.global_step
        ):
            return
        with self._unwatched():
            self._save(reason)
        position.last_checkpoint_step = position.global_step
        position.last_save_time = time.monotonic()

    @contextlib.contextmanager
    def _unwatched(self) -> Iterator[None]:
        """No stall watch while a checkpoint is written: a large one may take longer than
        dist.stall_timeout_s, and its barrier is bounded by dist.timeout_s."""
        watchdog = self._watchdog
        if watchdog is None or not watchdog.armed:
            yield
            return
        watchdog.disarm()
        try:
            yield
        finally:
            watchdog.arm()

    def _save(self, reason: str) -> None:
        context, position = self.context, self.position
        phases = {"replica_check": time.perf_counter()}
        self.check_replicas()
        phases["gather_state"] = time.perf_counter()
        state = self.checkpoint_state(finished=reason == "end of training")
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
        """Continue where the checkpoint left off: position, metric sums and, when it was
        written by as many ranks, every rank's random streams (returns whether it did)."""
        env, position = self.context.env, self.position
        position.epoch = int(saved["epoch"])
        position.step_in_epoch = int(saved["step_in_epoch"])
        position.global_step = int(saved["global_step"])
        position.train_time_s = float(saved["train_time_s"])
        position.resumed_from_step = position.global_step
        position.resumed_from_world_size = saved_world_size(saved)
        position.last_checkpoint_step = position.global_step
        self.metrics.restore(saved["metrics"])
        self.context.values.update(saved.get("values") or {})
        self._saved_streams = saved.get("streams")
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

    # -- ending ------------------------------------------------------------------------------

    def _stop(self) -> None:
        """The ranks agreed to stop: checkpoint, requeue if asked and allowed, end the run."""
        context, position = self.context, self.position
        position.stopped = True
        self.save("stop signal")
        requeued = False
        if context.env.is_main:
            if context.signals.wants_requeue:
                context.tracker.suspend()  # before requeueing: Slurm ends this step right after
                requeued = requeue_job(
                    context.environ, context.env.restart_count, context.config.preempt
                )
            if not requeued:
                context.tracker.finish("KILLED")
        # Every rank learns the outcome before exiting, so none exits early and takes the
        # step down while rank 0 is still requeueing.
        requeued = bool(broadcast_object(requeued, context.control_group))
        if context.env.is_main:
            if requeued:
                get_logger().info(f"stopped at step {position.global_step}; the job was requeued")
            else:
                get_logger().warning(
                    f"stopped at step {position.global_step} after a checkpoint; to continue, "
                    f"run the same command with run.id={context.run_dir.name}"
                )
        context.close(None)
        raise Stopped(position.global_step, requeued, context.run_dir.name)

    def finish(self) -> None:
        """After the last step: the final checkpoint and replica check."""
        self.metrics.publish()
        self.save("end of training")
        if self.position.last_checkpoint_step != self.position.global_step:
            self.check_replicas()  # not checked by a save at this step

    def close(self, wait: bool = True) -> None:
        """End the progress display and (``wait``) finish the stop agreement in flight; after
        a failure a peer may be gone, so nothing is waited for then."""
        self.metrics.progress.close()
        if self._watchdog is not None:
            self._watchdog.close()
        if wait and self._agreement is not None:
            self._agreement.close()
