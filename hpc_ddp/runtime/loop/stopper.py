"""The stop all ranks agree on: every few steps the ranks exchange whether a stop signal
came or the job's end is near (and whether a save is due by time); after the SAME step they
checkpoint, requeue if asked and allowed, and end the run. And the end no rank agrees to: the
stall watchdog of a rank whose steps stopped coming (:func:`start_watchdog`)."""

from __future__ import annotations

import functools
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from typing import NoReturn

from hpc_ddp.runtime.config import LOCAL_COMMAND_VARIABLE, OVERRIDES_VARIABLE
from hpc_ddp.runtime.errors import EXIT_STOPPED, Stopped
from hpc_ddp.runtime.exits import tell_elastic_agent
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.loop.checkpointer import Checkpointer
from hpc_ddp.runtime.loop.context import RunContext
from hpc_ddp.runtime.loop.position import Position
from hpc_ddp.runtime.monitor.datawait import DataWait
from hpc_ddp.runtime.place.dist import broadcast_object
from hpc_ddp.runtime.place.slurm import queue_job_id
from hpc_ddp.runtime.preempt.job_end import StopBeforeEnd, job_end_for
from hpc_ddp.runtime.preempt.liveness import Liveness
from hpc_ddp.runtime.preempt.lost_rank import write_handoff
from hpc_ddp.runtime.preempt.node_record import requeues_for_nodes
from hpc_ddp.runtime.preempt.progress import no_progress_refusal, record_attempt
from hpc_ddp.runtime.preempt.requeue import requeue_job
from hpc_ddp.runtime.preempt.signals import StepAgreement
from hpc_ddp.runtime.preempt.watchdog import StallWatchdog
from hpc_ddp.runtime.turns import LOCK_VAR, OutputTurns


def own_command() -> Sequence[str]:
    """This process's command line where typing it again runs the same program (a script, a
    module, ``-c``); () in an interactive session or a notebook, or for a program read from
    standard input."""
    interactive = hasattr(sys, "ps1") or sys.flags.interactive or "ipykernel" in sys.modules
    if interactive or not sys.argv or sys.argv[0] in ("", "-"):
        return ()
    return sys.orig_argv


def continue_hint(
    run_id: str, id_was_set: bool, environ: Mapping[str, str], command: Sequence[str] = ()
) -> str:
    """How to continue a stopped run, in the form that reaches the program at hand: the same
    command where it names the run; under ``hpc-ddp local`` its exact command with the id;
    ``command`` (plain ``python``: the process's own command line) with the id in
    $HPC_DDP_OVERRIDES, which reaches any script (its own arguments may refuse a setting)."""
    local_command = environ.get(LOCAL_COMMAND_VARIABLE)
    if id_was_set:
        return f"to continue, run the same command with run.id={run_id}"
    if local_command is not None:
        return f"to continue: hpc-ddp local --set run.id={run_id} {local_command}"
    overrides = shlex.join([*shlex.split(environ.get(OVERRIDES_VARIABLE, "")), f"run.id={run_id}"])
    variable = f"{OVERRIDES_VARIABLE}={shlex.quote(overrides)}"
    if command:
        return f"to continue: {variable} {shlex.join(command)}"
    return (
        f"to continue, run the same command with {variable} before it (or run.id={run_id} "
        "among its settings, where the script hands them to hpc_ddp)"
    )


class Stopper:
    """Decides with the other ranks when to stop or save, and carries a stop out."""

    def __init__(
        self,
        context: RunContext,
        position: Position,
        checkpointer: Checkpointer,
    ) -> None:
        self.context = context
        self.position = position
        self.checkpointer = checkpointer
        self._agreement: StepAgreement | None = None
        self._before_end: StopBeforeEnd | None = None

    def begin(self) -> None:
        """Before the first step: the agreement's background exchange; on rank 0 of a Slurm
        job, the job's end and when the stop before it will come, and the hand-off to the
        batch script marked as training."""
        several = self.context.env.world_size > 1
        self._agreement = StepAgreement(self.context.control_group if several else None)
        preempt = self.context.config.preempt
        self._record_the_attempt()
        if self.context.env.is_main:
            write_handoff(self.context.environ, self.context.run_dir, preempt, "training")
        job_end = job_end_for(self.context.environ, preempt) if self.context.env.is_main else None
        if job_end is not None:
            self._before_end = StopBeforeEnd(
                job_end.start(),
                self._save_s,
                preempt.end_margin_s,
                stopped_s=self.context.stops.total_at,
            )
            self._before_end.say_when()

    def decide(self, stopwatch: DataWait | None = None) -> tuple[bool, bool]:
        """(stop, save now), the same on every rank: a stop signal on any rank, or rank 0
        seeing the job's end near, stops all; rank 0's clock decides a save by
        ``checkpoint.every_minutes``. ``stopwatch`` times the ranks' exchange alone (where a
        rank waits for the slowest), not rank 0's reading of the job's end."""
        agreement = self._agreement
        if agreement is None:
            return False, False
        stop = self.context.signals.requested
        if not stop and self._before_end is not None and self._before_end.due():
            self.context.signals.rehearse()  # the warning signal's stop: requeue included
            stop = True
        save = self._save_due()
        if stopwatch is None:
            return agreement.exchange(stop, save)
        return stopwatch.timed(lambda: agreement.exchange(stop, save))

    def _record_the_attempt(self) -> None:
        """Rank 0 records this attempt and where it resumed (the run's time account); in a
        requeueable job with checkpoints, every rank ends when the attempts before it made no
        progress (preempt.max_attempts_without_progress)."""
        context, refusal = self.context, None
        job = queue_job_id(context.environ)
        if context.env.is_main:
            start_step = self.position.resumed_from_step or 0
            attempts = record_attempt(
                context.run_dir, job, context.env.restart_count, start_step, context.attempt_id,
                context.attempt_start_unix, context.env.world_size,
            )  # fmt: skip
            limit = context.config.preempt.max_attempts_without_progress
            refusal = no_progress_refusal(attempts, limit)
        if job is None or not context.config.checkpoint.enabled:
            return
        refusal = broadcast_object(refusal, context.control_group)
        if refusal is not None:
            raise refusal

    def _save_s(self) -> float | None:
        """What the last save took (a stop's save writes in full), or None before one."""
        saves, written = self.checkpointer.last_save_s, self.checkpointer.folders.last_write_s
        return max(sum(saves.values()), written or 0.0) if saves else None

    def rehearsal_due(self) -> bool:
        """Whether this step is ``preempt.stop_at_step``: every rank knows so at the same step,
        with no exchange; the warning signal is then recorded as if it had arrived."""
        at = self.context.config.preempt.stop_at_step
        if at is None or self.position.global_step != at:
            return False
        if self.context.env.is_main:
            get_logger().info(
                f"preempt.stop_at_step={at}: stopping as on the warning signal "
                f"(SIG{self.context.config.preempt.signal})"
            )
        self.context.signals.rehearse()
        return True

    def _save_due(self) -> bool:
        minutes = self.context.config.checkpoint.every_minutes
        if minutes is None or not self.context.env.is_main:
            return False
        return time.monotonic() - self.position.last_save_time >= minutes * 60

    def stop(self) -> NoReturn:
        """The ranks agreed to stop: checkpoint, requeue if asked and allowed, then raise
        :class:`hpc_ddp.Stopped` (the session ends the run as it leaves the loop)."""
        context, position = self.context, self.position
        position.stopped = True
        context.times.begin_ending("stop")
        self.checkpointer.save("stop signal")
        saved = context.config.checkpoint.enabled
        requeued = False
        if context.env.is_main:
            if context.signals.wants_requeue and not saved:
                # Another attempt would compute the same steps again and, stopped by the same
                # time limit, never get further: allocation spent for nothing.
                get_logger().warning(
                    "not requeueing: checkpoint.enabled=false, so another attempt would start "
                    "again from step 0"
                )
            elif context.signals.wants_requeue:
                context.tracker.suspend()  # before requeueing: Slurm ends this step right after
                # Requeues that left failed hosts out have a budget of their own.
                job = queue_job_id(context.environ)
                restarts = context.env.restart_count - requeues_for_nodes(context.run_dir, job)
                requeued = requeue_job(context.environ, restarts, context.config.preempt)
            if not requeued:
                context.tracker.finish("KILLED")
        # Every rank learns the outcome before exiting, so none exits early and takes the
        # step down while rank 0 is still requeueing.
        requeued = bool(broadcast_object(requeued, context.control_group))
        if requeued:
            if context.env.is_main:
                get_logger().info(f"stopped at step {position.global_step}; the job was requeued")
        else:
            if saved:
                hint = continue_hint(
                    context.run_dir.name,
                    context.config.run.id is not None,
                    context.environ,
                    own_command() if context.env.launcher == "single" else (),
                )
                stopped = f"stopped at step {position.global_step} after a checkpoint; {hint}"
            else:
                stopped = (
                    f"stopped at step {position.global_step} without a checkpoint "
                    "(checkpoint.enabled=false): the same command again starts from step 0"
                )
            # torchrun reports every non-zero exit as a failure: its summary says this instead.
            tell_elastic_agent(
                f"{stopped} (exit code {EXIT_STOPPED}: a stop, not a failure)",
                context.environ,
                time.time(),
            )
            if context.env.is_main:
                get_logger().warning(stopped)
        raise Stopped(position.global_step, requeued, context.run_dir.name, checkpointed=saved)

    def close(self, wait: bool = True) -> None:
        """Stop reading the job's end; (``wait``) finish the exchange in flight (only on a
        clean end: after a failure a peer may be gone)."""
        if self._before_end is not None:
            self._before_end.close()
        if wait and self._agreement is not None:
            self._agreement.close()


def start_watchdog(context: RunContext, position: Position) -> StallWatchdog | None:
    """The stall watchdog for this rank's steps (None: ``dist.stall_timeout_s`` is off); its
    looks find the time this process did not run (``context.stops``)."""
    settings = context.config.dist
    if settings.stall_timeout_s is None:
        return None

    def where() -> str:
        return (
            f"epoch {position.epoch}, step {position.global_step + 1} of the run "
            f"({position.step_in_epoch + 1} of the epoch)"
        )

    env = context.env
    liveness = (
        Liveness(
            env.master_addr,
            env.master_port,
            env.rank,
            env.world_size,
            env.elastic_restarts,
            node=context.node,
        )
        if env.world_size > 1
        else None
    )
    return StallWatchdog(
        settings.stall_timeout_s,
        settings.timeout_s,
        env.rank,
        where,
        functools.partial(_end_stalled, context, position),
        liveness,
        output=OutputTurns(context.environ.get(LOCK_VAR)),
        stops=context.stops,
    ).start()


def _end_stalled(context: RunContext, position: Position, failure: Mapping[str, object]) -> None:
    """End the run of a rank the watchdog found stalled, what ended it on record first."""
    context.record_failure(failure, position.global_step)
    context.tracker.finish("FAILED")
