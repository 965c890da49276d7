""":func:`start`: one call at the top of a training script turns it into an hpc_ddp run."""

from __future__ import annotations

import functools
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hpc_ddp.runtime.arguments import optional_whole_number
from hpc_ddp.runtime.checkpoint.files import Found, supersede
from hpc_ddp.runtime.checkpoint.fingerprint import check_resumable, fingerprint_of
from hpc_ddp.runtime.checkpoint.loading import find_resume
from hpc_ddp.runtime.config import (
    CheckpointConfig,
    ChecksConfig,
    DistConfig,
    MonitorConfig,
    PreemptConfig,
    RunConfig,
    RuntimeConfig,
    TrackingConfig,
    default_run_name,
    resolve_config,
)
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.loop.context import RunContext
from hpc_ddp.runtime.loop.position import Position
from hpc_ddp.runtime.loop.steps import StepLoop
from hpc_ddp.runtime.loop.streams import map_tensors
from hpc_ddp.runtime.monitor.account import attempt_start_unix
from hpc_ddp.runtime.monitor.forward.meter import ForwardMeter
from hpc_ddp.runtime.monitor.gradsync import GradientSyncMeter
from hpc_ddp.runtime.monitor.timeline import (
    mark,
    mark_allocation_start,
    new_timeline,
    slurm_job_start_unix,
)
from hpc_ddp.runtime.place.checking import check_before_training, record_checks
from hpc_ddp.runtime.place.plan import LaunchPlan
from hpc_ddp.runtime.place.slurm import squeue_job_start
from hpc_ddp.runtime.preempt.exclusion import answer_failed_checks
from hpc_ddp.runtime.preempt.progress import end_attempt
from hpc_ddp.runtime.preempt.signals import StopSignals
from hpc_ddp.runtime.session.ending import Ending, end_active_run, install_excepthook, watch
from hpc_ddp.runtime.session.joining import (
    join_ranks,
    refuse_a_start_that_cannot_join,
    resolve_launch,
    settle_rank,
)
from hpc_ddp.runtime.session.run import Run
from hpc_ddp.runtime.tracking.base import NullTracker, Tracker
from hpc_ddp.runtime.tracking.opening import open_tracker
from hpc_ddp.runtime.tracking.provenance import agree_on_code
from hpc_ddp.runtime.tracking.record import STATUS_FILE
from hpc_ddp.runtime.tracking.worker import discard_prestarted

__all__ = ["end_active_run", "start"]


def forward_meter(settings: RuntimeConfig, plan: LaunchPlan) -> ForwardMeter:
    """The meter of this rank's forward: rank 0 counts the model's FLOPs where no
    ``monitor.flops_per_sample`` is given and ``monitor.count_flops`` asks for it."""
    monitor = settings.monitor
    count = monitor.count_flops and not monitor.flops_per_sample and plan.dist_env.is_main
    return ForwardMeter(torch.device(plan.device.device), count, map_tensors)


def _resume_point(plan: LaunchPlan, settings: RuntimeConfig, group: Any | None) -> Found | None:
    """The checkpoint this run resumes from (checkpoint.resume), else None; a run that
    starts anew supersedes the checkpoints an earlier run of its id left."""
    run_dir, dist_env, enabled = plan.run_dir, plan.dist_env, settings.checkpoint.enabled
    if not settings.checkpoint.resume:
        if dist_env.is_main and enabled:
            supersede(run_dir)
        return None
    resume = find_resume(
        run_dir, dist_env.rank, group, settings.checkpoint.start_fresh_if_unreadable
    )
    if resume is None and enabled and dist_env.is_main and (run_dir / STATUS_FILE).exists():
        get_logger().warning(
            f"run {run_dir} ran before but left no checkpoint: it starts again at step 0, in "
            "the same MLflow run. HINT: stop a run with Ctrl-C or a stop signal (it "
            "checkpoints first), or set checkpoint.every_steps"
        )
    return resume


def start(
    config: RuntimeConfig | str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    name: str | None = None,
    run: Mapping[str, Any] | RunConfig | None = None,
    dist: Mapping[str, Any] | DistConfig | None = None,
    checkpoint: Mapping[str, Any] | CheckpointConfig | None = None,
    preempt: Mapping[str, Any] | PreemptConfig | None = None,
    tracking: Mapping[str, Any] | TrackingConfig | None = None,
    checks: Mapping[str, Any] | ChecksConfig | None = None,
    monitor: Mapping[str, Any] | MonitorConfig | None = None,
    params: Mapping[str, Any] | None = None,
    fingerprint: Mapping[str, Any] | None = None,
    log_interval: int | None = None,
    export_env: bool = True,
    environ: Mapping[str, str] | None = None,
) -> Run:
    """Start a run on this rank; see :class:`Run` for what to do with it.

    It resolves the launcher (torchrun, ``hpc-ddp local``, a Slurm step, submitit, or one
    process) once, checks the launch before any process group (HpcDdpError with a HINT),
    selects the GPU, joins the other ranks within ``dist.init_timeout_s``, handles stop
    signals (also those that came while the script was starting), seeds the random streams
    with ``run.seed`` and finds the newest checkpoint of this run to resume from. MLflow
    starts lazily on rank 0 only.

    Settings: ``config`` (a RuntimeConfig or a YAML file of the sections run, dist,
    checkpoint, preempt, tracking, checks, monitor), then the sections as keyword arguments
    (a dict of keys, or the section's dataclass), then dotted ``overrides`` such as
    ``checkpoint.every_steps=100``.
    ``name``: the run's name (default ``run.name``, else the script's name). ``params``:
    your hyper-parameters, logged to MLflow. ``fingerprint``: values a resume must find
    unchanged. ``log_interval``: steps between interval metrics (default about 5 s).
    ``export_env`` writes RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ... into os.environ
    for code that reads them (each overwrite is logged).
    """
    # The wall clock first: the run's MLflow duration (from entry_unix) is never shorter
    # than its wall_time_s (from started), however long the process waits between the two.
    entry_unix, started = time.time(), time.perf_counter()
    install_excepthook()
    environment = os.environ if environ is None else environ
    refuse_a_start_that_cannot_join(environment)
    sections = {"run": run, "dist": dist, "checkpoint": checkpoint, "preempt": preempt,
                "tracking": tracking, "checks": checks, "monitor": monitor}  # fmt: skip
    try:
        log_interval = optional_whole_number(log_interval, "hpc_ddp.start(log_interval)")
        settings = resolve_config(config, overrides, sections, environment)
    except HpcDdpError as error:  # every rank read the same settings: said once a host
        raise HpcDdpError(error.message, error.hint, error.exit_code, True) from None
    run_name = name or settings.run.name or default_run_name()
    log_interval = log_interval or settings.run.log_interval
    plan = resolve_launch(settings, run_name, environment)
    if not (plan.dist_env.is_main and settings.tracking.enabled):
        discard_prestarted()
    settle_rank(plan, settings, environment, export_env)
    preempt = settings.preempt
    signals = StopSignals(preempt.signal, preempt.stop_on_sigterm, plan.dist_env.is_main).install()
    timeline = new_timeline(entry_unix)
    tracker: Tracker = NullTracker()
    try:
        joined = join_ranks(plan, settings, environment, timeline)
        plan = joined.plan
        if plan.dist_env.is_main:  # the restarts torchrun's agents agree on are known now
            restarts = plan.dist_env.elastic_restarts
            ask = functools.partial(squeue_job_start, environ=environment)
            mark_allocation_start(timeline, slurm_job_start_unix(environment, restarts, ask))
        checks = None
        if settings.checks.enabled:  # before anything of the run is read or opened
            shared = settings.checkpoint.enabled
            group = joined.control_group
            checks = check_before_training(plan, settings.checks, environment, group, shared)
            if checks["failures"]:
                answer_failed_checks(checks, plan, preempt, environment, group, signals)
            mark(timeline, "checked")
        resume = _resume_point(plan, settings, joined.control_group)
        finished_before = resume is not None and bool(resume[1].get("finished"))
        if checks is not None and plan.dist_env.is_main and not finished_before:
            record_checks(plan.run_dir, checks)
        values = fingerprint_of(fingerprint or {})
        if resume is not None:  # refused before MLflow reopens the run it names
            check_resumable(resume[1]["fingerprint"], values, resume[0])
        code = None
        if not finished_before:
            resumed, on_change = resume is not None, settings.run.on_code_change
            main, group = plan.dist_env.is_main, joined.control_group
            code = agree_on_code(plan.run_dir, main, resumed, on_change, environment, group)
        position = Position()
        if plan.dist_env.is_main:
            tracker = open_tracker(
                settings,
                plan,
                run_name,
                params,
                resume,
                lambda: (position.global_step, position.epoch),
                lambda: position.resumed_from_step or 0,
                entry_unix,
                code,
            )
        context = RunContext(
            config=settings,
            plan=plan,
            control_group=joined.control_group,
            checkpoint_group=joined.checkpoint_group,
            signals=signals,
            tracker=tracker,
            environ=environment,
            fingerprint=values,
            log_interval=log_interval,
            forward=forward_meter(settings, plan),
            gradient_sync=GradientSyncMeter(
                torch.device(plan.device.device), settings.monitor.time_gradient_sync
            ),
            attempt_start_unix=attempt_start_unix(timeline, time.time()),
        )
        loop = StepLoop(context, position)
        try:
            record_end = _attempt_record(context, timeline)
            ending = Ending(
                signals, str(plan.dist_env.rank), tracker, loop.close, position, record_end,
                context.record_failure,
            )  # fmt: skip
            handle = Run(context, loop, ending, resume, started, timeline)
        except BaseException:
            loop.close(wait=False)  # its monitor's thread and torch's global hooks
            raise
        torch.manual_seed(settings.run.seed)  # the same initial weights on every rank
        random.seed(settings.run.seed)
    except BaseException:
        discard_prestarted()
        tracker.finish("FAILED")
        signals.restore()
        raise
    watch(ending)
    mark(timeline, "started")
    return handle


def _attempt_record(
    context: RunContext, timeline: dict[str, float]
) -> Callable[[str | None, int, int], Mapping[str, Any] | None]:
    """How this attempt's end goes on record: rank 0 adds it to attempts.json; the other
    ranks keep no record."""
    env = context.env
    if not env.is_main:
        return lambda status, last_step, from_step: None
    return functools.partial(
        end_attempt, context.run_dir, context.attempt_id, timeline, context.times,
        env.world_size,
    )  # fmt: skip
