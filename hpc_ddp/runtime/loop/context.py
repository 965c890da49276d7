"""What the parts of a run share: its settings, place, device, groups and services."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpc_ddp.runtime.checkpoint.state import Registry
from hpc_ddp.runtime.config import RuntimeConfig
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.loop.streams import map_tensors
from hpc_ddp.runtime.monitor.attempt_times import AttemptTimes
from hpc_ddp.runtime.monitor.forward.meter import ForwardMeter
from hpc_ddp.runtime.monitor.gradsync import GradientSyncMeter
from hpc_ddp.runtime.place.env import DistEnv
from hpc_ddp.runtime.place.plan import LaunchPlan
from hpc_ddp.runtime.place.slurm import queue_job_id
from hpc_ddp.runtime.preempt.liveness import ProcessStops
from hpc_ddp.runtime.preempt.progress import record_failure
from hpc_ddp.runtime.preempt.signals import StopSignals
from hpc_ddp.runtime.preempt.watchdog import CHECK_PERIOD_S
from hpc_ddp.runtime.tracking.base import Tracker


@dataclass
class RunContext:
    """One run's shared state on this rank, built once by :func:`hpc_ddp.start`."""

    config: RuntimeConfig
    plan: LaunchPlan
    #: The (gloo) group for control messages: stop agreement, barriers, small objects. None
    #: with one rank.
    control_group: Any | None
    signals: StopSignals
    tracker: Tracker
    #: The environment the launch was resolved from (requeue reads the job's ids from it).
    environ: Mapping[str, str]
    #: Values a resume must find unchanged in the checkpoint.
    fingerprint: dict[str, str]
    #: Steps between interval metrics; None: about every 5 s (measured).
    log_interval: int | None
    #: A gloo group of its own for checkpoints written in the background (None: saves use
    #: ``control_group``).
    checkpoint_group: Any | None = None
    registry: Registry = field(default_factory=Registry)
    #: Plain values the user keeps in :attr:`hpc_ddp.Run.state`, saved in every checkpoint.
    values: dict[str, Any] = field(default_factory=dict)
    #: Models given to :meth:`hpc_ddp.Run.wrap` (their modules).
    wrapped: list[nn.Module] = field(default_factory=list)
    #: The time this process did not run (a suspended job), as the stall watchdog's looks
    #: find it; the stop before the job's end and the time account leave it out.
    stops: ProcessStops = field(default_factory=lambda: ProcessStops(CHECK_PERIOD_S))
    #: This attempt's time in resumes, checkpoints, evaluation and steps, less ``stops``.
    times: AttemptTimes = field(init=False)
    #: This rank's time in its wrapped models' forward (and their FLOPs, where counted).
    forward: ForwardMeter = field(
        default_factory=lambda: ForwardMeter(torch.device("cpu"), False, map_tensors)
    )
    #: This rank's wait for its wrapped models' gradient all-reduce (DDP).
    gradient_sync: GradientSyncMeter = field(
        default_factory=lambda: GradientSyncMeter(torch.device("cpu"))
    )
    #: When this attempt's allocation began (its job's start or its process's): the
    #: start a later attempt charges it from if it is killed outright.
    attempt_start_unix: float = field(default_factory=time.time)
    #: Names this attempt's entry in the run's attempts.json.
    attempt_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    _failure_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _failure_recorded: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.times = AttemptTimes(suspended=self.stops.so_far)

    @property
    def env(self) -> DistEnv:
        return self.plan.dist_env

    @property
    def device(self) -> torch.device:
        return torch.device(self.plan.device.device)

    @property
    def node(self) -> str:
        """This host as Slurm names it (``SLURMD_NODENAME``), else its hostname."""
        return self.environ.get("SLURMD_NODENAME") or self.env.hostname

    @property
    def run_dir(self) -> Path:
        return self.plan.run_dir

    def record_failure(self, failure: Mapping[str, Any], step: int) -> None:
        """Add what ended this rank at ``step`` to the run's failures, with the time and the
        rank, host, job and restart that say whose it is. Once per attempt: the first cause
        stands (a stalled rank whose collective then fails is one failure, whichever thread
        is first). A record that cannot be written costs one warning: the rank still ends."""
        with self._failure_lock:
            if self._failure_recorded:
                return
            self._failure_recorded = True
        env = self.env
        where = {
            "rank": env.rank,
            "host": self.node,
            "job": queue_job_id(self.environ),
            "restart_count": env.restart_count,
        }
        try:
            record_failure(self.run_dir, where, {**failure, "step": step, "time": time.time()})
        except Exception as unwritten:
            get_logger().warning(f"what ended this rank was not recorded: {unwritten!r}")

    def models(self) -> list[nn.Module]:
        """The models trained: the wrapped ones, else the registered."""
        if self.wrapped:
            return list(self.wrapped)
        return [value for value in self.registry.objects.values() if isinstance(value, nn.Module)]

    def current_lr(self) -> float | None:
        """The first registered optimizer's first parameter group's learning rate."""
        for value in self.registry.objects.values():
            if isinstance(value, torch.optim.Optimizer):
                return float(value.param_groups[0]["lr"])
        return None
