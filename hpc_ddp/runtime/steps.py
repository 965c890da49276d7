"""The step boundary: what happens between one optimizer step and the next.

:class:`StepLoop` counts steps over a loader's micro-batches and, at step boundaries only,
does what a run needs: interval metrics summed across ranks in the background, the agreed
stop (every rank stops after the SAME step, then checkpoints and maybe requeues), periodic
checkpoints by steps or minutes, and exact epoch sums. Nothing in it synchronises the
device per step; the stop agreement is a CPU (gloo) all-reduce overlapped with the next step.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hpc_ddp.runtime.checkpoint import FORMAT_VERSION, checkpoint_dir, save_checkpoint
from hpc_ddp.runtime.context import RunContext
from hpc_ddp.runtime.dist import broadcast_object, several_ranks
from hpc_ddp.runtime.errors import Stopped
from hpc_ddp.runtime.logs import Progress, get_logger
from hpc_ddp.runtime.metrics import PendingSums, Sum, Sums, restore_sums, saved_sums
from hpc_ddp.runtime.replicas import diverged_replicas
from hpc_ddp.runtime.requeue import requeue_job
from hpc_ddp.runtime.signals import StepAgreement
from hpc_ddp.runtime.state import gathered_rng_states, restore_rng

#: The stop-signal check period the automatic setting aims at, and its upper bound in steps.
CHECK_PERIOD_S = 1.0
CHECK_EVERY_MAX = 1000
#: With log_interval=None: the first log step, then the period aimed at and its bound.
FIRST_LOG_INTERVAL = 20
LOG_PERIOD_S = 5.0
LOG_INTERVAL_MAX = 10000


@dataclass
class Position:
    """Where the run is; what a checkpoint records."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    train_time_s: float = 0.0
    resumed_from_step: int | None = None
    stopped: bool = False
    last_checkpoint_step: int = -1
    last_save_time: float = field(default_factory=time.monotonic)
    #: Wall-clock time (Unix) of this process's first finished optimizer step.
    first_step_unix: float | None = None
    #: The first step after which some rank's weights differed from rank 0's (None: never).
    replicas_diverged_at: int | None = None


@dataclass(frozen=True)
class IntervalReport:
    """One log interval's metrics, summed across ranks in the background."""

    sums: PendingSums
    names: list[str]
    step: int
    epoch: int
    steps: int
    seconds: float
    lr: float | None


class StepLoop:
    """Epochs and steps of one run on this rank (see the module docstring)."""

    def __init__(self, context: RunContext, log_interval: int | None) -> None:
        self.context = context
        self.position = Position()
        self.interval = Sums(context.device, context.control_group)
        self.epoch_sums = Sums(context.device, context.control_group)
        #: The last finished epoch's training metrics, summed over all ranks.
        self.epoch_metrics: dict[str, Sum] = {}
        self.num_epochs: int | None = None
        self.max_steps: int | None = None
        self.accumulating = False
        self.completed = False
        self.global_batch_size: int | None = None
        preempt = context.config.preempt
        self.check_every = preempt.check_every_steps or 1
        self.log_interval = log_interval or FIRST_LOG_INTERVAL
        self._calibrated = preempt.check_every_steps is not None and log_interval is not None
        self._interval_steps = 0
        self._interval_started = time.perf_counter()
        self._pending_report: IntervalReport | None = None
        self._agreement: StepAgreement | None = None
        self._progress = Progress(None, enabled=False)
        self._begun = False

    # -- starting ----------------------------------------------------------------------------

    def begin(self, before_first_step: Callable[[], object]) -> None:
        """Once, before the first step: ``before_first_step`` (the resume), the stop
        agreement, and the garbage collector told that everything alive now stays."""
        if self._begun:
            return
        self._begun = True
        before_first_step()
        several = self.context.env.world_size > 1
        self._agreement = StepAgreement(self.context.control_group if several else None)
        self._progress = Progress(self._total_steps(), enabled=self.context.env.is_main)
        gc.freeze()

    def _total_steps(self, steps_per_epoch: int | None = None) -> int | None:
        by_epochs = None
        if self.num_epochs is not None and steps_per_epoch is not None:
            by_epochs = self.num_epochs * steps_per_epoch
        limits = [limit for limit in (by_epochs, self.max_steps) if limit is not None]
        return min(limits) if limits else None

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

    # -- the steps ---------------------------------------------------------------------------

    def steps(self, loader: Any) -> Iterator[Any]:
        """The rest of the current epoch's micro-batches (see :meth:`hpc_ddp.Run.steps`)."""
        position = self.position
        accum = loader.grad_accum_steps
        self.global_batch_size = loader.global_batch_size
        total = self._total_steps(loader.steps_per_epoch)
        self._progress.total_steps = total
        left = loader.steps_per_epoch - position.step_in_epoch
        if total is not None:
            left = min(left, total - position.global_step)
        loader.set_position(position.epoch, position.step_in_epoch)
        started = self._interval_started = time.perf_counter()
        self._interval_steps = 0
        micro = 0
        try:
            batches = iter(loader)
            while left > 0:
                batch = next(batches, None)
                if batch is None:
                    break
                self.accumulating = micro < accum - 1
                yield batch
                micro += 1
                if micro < accum:
                    continue
                micro = 0
                left -= 1
                self._after_step()
        finally:
            self.accumulating = False
            if self.context.device.type == "cuda":
                torch.cuda.synchronize(self.context.device)  # the epoch's kernels count too
            position.train_time_s += time.perf_counter() - started
        self._end_epoch()

    def _after_step(self) -> None:
        position = self.position
        if position.first_step_unix is None:
            position.first_step_unix = time.time()
        position.global_step += 1
        position.step_in_epoch += 1
        self._interval_steps += 1
        if position.global_step % self.log_interval == 0:
            self._log_interval()
        stop, save_now = False, False
        if position.global_step % self.check_every == 0 and self._agreement is not None:
            stop, save_now = self._agreement.exchange(
                self.context.signals.requested, self._save_due_by_time()
            )
        if stop:
            self._stop()
        every_steps = self.context.config.checkpoint.every_steps
        if save_now or (every_steps and position.global_step % every_steps == 0):
            self.save("periodic")

    def _save_due_by_time(self) -> bool:
        minutes = self.context.config.checkpoint.every_minutes
        if minutes is None or not self.context.env.is_main:
            return False
        return time.monotonic() - self.position.last_save_time >= minutes * 60

    # -- metrics -----------------------------------------------------------------------------

    def _calibrate_periods(self, elapsed_s: float) -> None:
        """Agree the periods left automatic: stop-signal checks about once per second and
        log steps about every LOG_PERIOD_S seconds of training.

        Rank 0's measured step rate decides and is broadcast, so every rank checks and logs at
        the same steps (both are collectives)."""
        steps_per_s = self._interval_steps / max(1e-9, elapsed_s)

        def steps_for(seconds: float, most: int) -> int:
            return max(1, min(most, round(steps_per_s * seconds)))

        periods = (
            self.context.config.preempt.check_every_steps
            or steps_for(CHECK_PERIOD_S, CHECK_EVERY_MAX),
            self.context.log_interval or steps_for(LOG_PERIOD_S, LOG_INTERVAL_MAX),
        )
        self.check_every, self.log_interval = broadcast_object(periods, self.context.control_group)
        self._calibrated = True
        if self.context.env.is_main:
            get_logger().info(
                f"stop signals are checked every {self.check_every} step(s); progress and "
                f"interval metrics every {self.log_interval} step(s)"
            )

    def _move_interval_to_epoch(self) -> tuple[list[str], torch.Tensor]:
        """The interval's metrics, packed, added to the epoch's (a collective: the names are
        compared across ranks)."""
        self.interval.agree()
        names, local = self.interval.names, self.interval.local()
        for index, name in enumerate(names):
            self.epoch_sums.add(name, local[2 * index], local[2 * index + 1])
        self.interval.clear()
        return names, local

    def _log_interval(self) -> None:
        """Start summing this interval's metrics across ranks; publish the previous one's.

        The all-reduce runs in the background until the next log step, so no rank waits for
        the others here and a GPU is never synchronised; each interval's line and metrics
        appear one interval late, under their own step."""
        now = time.perf_counter()
        if not self._calibrated:
            self._calibrate_periods(now - self._interval_started)
        names, local = self._move_interval_to_epoch()
        report = IntervalReport(
            PendingSums(local.clone()),
            names,
            self.position.global_step,
            self.position.epoch,
            self._interval_steps,
            now - self._interval_started,
            self.context.current_lr(),
        )
        self._interval_started, self._interval_steps = now, 0
        self.publish_interval()
        self._pending_report = report

    def publish_interval(self) -> None:
        """Log the interval whose sums are on their way (if any): progress line and metrics."""
        report, self._pending_report = self._pending_report, None
        if report is None:
            return
        values = report.sums.result()
        means = {
            name: values[2 * i] / values[2 * i + 1] if values[2 * i + 1] else float("nan")
            for i, name in enumerate(report.names)
        }
        samples_per_s = report.steps * (self.global_batch_size or 0) / max(1e-9, report.seconds)
        self._progress.update(report.step, report.epoch, means, samples_per_s)
        metrics = {f"interval/{name}": value for name, value in means.items()}
        metrics["interval/samples_per_s"] = samples_per_s
        if report.lr is not None:
            metrics["lr"] = report.lr
        self.context.tracker.log_metrics(metrics, report.step)

    def _end_epoch(self) -> None:
        """The epoch's training metrics, summed over all ranks, logged under epoch + 1."""
        self.publish_interval()
        self._move_interval_to_epoch()
        self.epoch_metrics = self.epoch_sums.reduce()
        self.epoch_sums.clear()
        scalars = {
            name: float(value.mean)
            for name, value in self.epoch_metrics.items()
            if not isinstance(value.total, torch.Tensor)
        }
        if scalars:
            self.context.tracker.log_metrics(scalars, self.position.epoch + 1)

    # -- checkpoints -------------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything a resume needs (collective: every rank calls it, rank 0 writes it)."""
        context, position = self.context, self.position
        rng = gathered_rng_states(context.device, context.control_group)
        metrics = {"interval": saved_sums(self.interval), "epoch": saved_sums(self.epoch_sums)}
        if not context.env.is_main:
            return {}
        return {
            "format": FORMAT_VERSION,
            "objects": context.registry.state_dicts(),
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
        }

    def save(self, reason: str) -> None:
        """Rank 0 writes; all ranks wait until the file is in place."""
        self.publish_interval()
        position = self.position
        if (
            not self.context.config.checkpoint.enabled
            or position.last_checkpoint_step == position.global_step
        ):
            return
        self.check_replicas()
        state = self.checkpoint_state()
        if self.context.env.is_main:
            started = time.perf_counter()
            path = save_checkpoint(
                state,
                checkpoint_dir(self.context.run_dir),
                position.global_step,
                self.context.config.checkpoint.keep_last,
            )
            get_logger().info(
                f"checkpoint ({reason}) step {position.global_step}: {path} "
                f"({time.perf_counter() - started:.2f} s)"
            )
        if several_ranks():
            dist.barrier(group=self.context.control_group)
        position.last_checkpoint_step = position.global_step
        position.last_save_time = time.monotonic()

    def restore(self, saved: dict[str, Any]) -> None:
        """Continue where the checkpoint left off: position, metric sums, random streams."""
        env, position = self.context.env, self.position
        position.epoch = int(saved["epoch"])
        position.step_in_epoch = int(saved["step_in_epoch"])
        position.global_step = int(saved["global_step"])
        position.train_time_s = float(saved["train_time_s"])
        position.resumed_from_step = position.global_step
        position.last_checkpoint_step = position.global_step
        restore_sums(self.interval, saved["metrics"]["interval"], carrier=env.is_main)
        restore_sums(self.epoch_sums, saved["metrics"]["epoch"], carrier=env.is_main)
        if len(saved["rng"]) == env.world_size:
            restore_rng(saved["rng"][env.rank], self.context.device)

    def check_replicas(self) -> None:
        """Compare every rank's weights with rank 0's; report the first divergence loudly."""
        for model in self.context.models():
            diverged = diverged_replicas(
                model, self.context.env.world_size, self.context.control_group
            )
            if not diverged or self.position.replicas_diverged_at is not None:
                continue
            step = self.position.replicas_diverged_at = self.position.global_step
            if self.context.env.is_main:
                ranks = ", ".join(f"rank {rank} ({name})" for rank, name in diverged)
                get_logger().error(
                    f"model replicas differ from rank 0's at step {step}: {ranks}; checkpoints "
                    "hold rank 0's weights. HINT: DDP keeps replicas equal only when every "
                    "rank makes the same update: look for parameters or buffers changed "
                    "outside the optimizer on some ranks only (in-place edits, "
                    "rank-dependent branches, buffers not broadcast)"
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
        self.publish_interval()
        self.save("end of training")
        if self.position.last_checkpoint_step != self.position.global_step:
            self.check_replicas()  # not checked by a save at this step

    def close(self, wait: bool = True) -> None:
        """End the progress display and (``wait``) finish the stop agreement in flight; after
        a failure a peer may be gone, so nothing is waited for then."""
        self._progress.close()
        if wait and self._agreement is not None:
            self._agreement.close()
