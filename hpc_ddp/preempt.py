"""Stop signals and requeue.

The signal handler only records the signal. At step boundaries the ranks agree through one
tiny all-reduce on a CPU (gloo) group, overlapped with the next step, so every rank stops
after the SAME step; then they checkpoint together and rank 0 may requeue the job.
"""

from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Mapping
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from hpc_ddp.config import PreemptConfig
from hpc_ddp.errors import EXIT_STOPPED
from hpc_ddp.logs import get_logger
from hpc_ddp.startup_signals import release_stop_signals

__all__ = [
    "EXIT_STOPPED",
    "StepAgreement",
    "StopSignals",
    "agent_signal_gap",
    "requeue_job",
    "requeue_target",
]


class StopSignals:
    """Records stop signals; nothing else happens inside the handler."""

    def __init__(self, warning_signal: str, stop_on_sigterm: bool = True) -> None:
        self.warning = signal.Signals[f"SIG{warning_signal}"]
        self.stop_on_sigterm = stop_on_sigterm
        self.received: set[int] = set()
        self._previous: dict[int, Any] = {}

    def _record(self, signum: int, _frame: FrameType | None) -> None:
        self.received.add(signum)

    def _ignore(self, _signum: int, _frame: FrameType | None) -> None:
        pass

    def install(self) -> StopSignals:
        """Handle the stop signals from now on, including any held during start-up.

        A held signal is raised again once the handlers are in place, so it meets exactly the
        handling it would have met arriving now: recorded, ignored, or (not a stop signal
        here) its default action."""
        arrived_during_startup = release_stop_signals()
        self._previous[self.warning] = signal.signal(self.warning, self._record)
        if self.warning != signal.SIGTERM:
            term_handler = self._record if self.stop_on_sigterm else self._ignore
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, term_handler)
        for signum in arrived_during_startup:
            get_logger().warning(
                f"{signal.Signals(signum).name} arrived while this rank was starting; "
                "handling it now"
            )
            signal.raise_signal(signum)
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return bool(self.received)

    @property
    def wants_requeue(self) -> bool:
        """The warning signal (preemption, time limit ahead) asks for a requeue; SIGTERM alone
        (scancel) asks only to stop cleanly."""
        return self.warning in self.received


class StepAgreement:
    """Every rank learns whether ANY rank wants to stop (or save), at the same step.

    Each call sends this step's flags and returns the agreed flags of the previous call: the
    all-reduce runs in the background during the step in between, so the hot loop never
    waits for it, and all ranks act on the same decision at the same step.
    """

    def __init__(self, group: Any | None) -> None:
        self.group = group
        self._pending: Any | None = None
        self._flags = torch.zeros(2)

    def exchange(self, stop: bool, save: bool) -> tuple[bool, bool]:
        agreed = (False, False)
        if self._pending is not None:
            self._pending.wait()
            agreed = (bool(self._flags[0] > 0), bool(self._flags[1] > 0))
        self._flags = torch.tensor([float(stop), float(save)])
        if self.group is None:
            self._pending = None
            return agreed[0] or stop, agreed[1] or save
        self._pending = dist.all_reduce(self._flags, group=self.group, async_op=True)
        return agreed

    def close(self) -> None:
        """Finish the collective in flight, so the group is quiet before teardown."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None


def agent_signal_gap(launcher: str, environ: Mapping[str, str], warning_signal: str) -> str | None:
    """Why the warning signal may be lost under torchrun in a Slurm job, or None.

    Slurm signals every process of a step, torchrun's agent included; an agent that does not
    handle the signal dies of it and takes the step down while the ranks checkpoint. torch
    >= 2.9 tells its ranks which signals the agent handles (TORCHELASTIC_SIGNALS_TO_HANDLE).
    """
    if launcher != "torchelastic" or "SLURM_JOB_ID" not in environ:
        return None
    wanted = f"SIG{warning_signal}"
    handled = environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    if handled is not None and wanted in {name.strip() for name in handled.split(",")}:
        return None
    seen = "this torch's torchrun cannot" if handled is None else f"it handles only {handled}"
    return (
        f"torchrun's agent does not handle {wanted} ({seen}): Slurm's warning signal kills the "
        "agent and ends the step while the ranks checkpoint. HINT: with torch >= 2.9 export "
        f"PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,{wanted} before torchrun (as "
        "slurm/train-torchrun.sh does); with older torch start the ranks with srun "
        "(slurm/train.sh)"
    )


def requeue_target(environ: Mapping[str, str]) -> str | None:
    """The id `scontrol requeue` needs: the array task (<array id>_<task id>) or the job."""
    array_job, array_task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    return environ.get("SLURM_JOB_ID")


def _job_allows_requeue(job_id: str, timeout_s: float) -> bool:
    result = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    match = re.search(r"\bRequeue=(\d)", result.stdout)
    return bool(match and match.group(1) == "1")


def requeue_job(environ: Mapping[str, str], restart_count: int, config: PreemptConfig) -> bool:
    """Rank 0: requeue this Slurm job if allowed and within budget. True if it was requeued."""
    log = get_logger()
    target = requeue_target(environ)
    if not config.requeue or target is None:
        log.info("not requeueing: " + ("preempt.requeue=false" if target else "not a Slurm job"))
        return False
    if restart_count >= config.max_requeues:
        log.warning(
            f"not requeueing: the job was already requeued {restart_count} time(s), "
            f"preempt.max_requeues={config.max_requeues}"
        )
        return False
    try:
        if not _job_allows_requeue(target, config.requeue_timeout_s):
            log.warning(
                f"not requeueing: job {target} does not allow requeue (submit with --requeue)"
            )
            return False
        result = subprocess.run(
            ["scontrol", "requeue", target],
            capture_output=True,
            text=True,
            timeout=config.requeue_timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        log.error(f"scontrol requeue {target} failed: {error}")
        return False
    if result.returncode != 0:
        log.error(f"scontrol requeue {target} failed: {result.stderr.strip()}")
        return False
    log.info(f"requeued job {target} (attempt {restart_count + 1} of {config.max_requeues})")
    return True
