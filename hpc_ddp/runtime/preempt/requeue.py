"""Requeueing a stopped Slurm job from rank 0, and the checks that Slurm's warning signal is
the one the ranks (and torchrun's agent) handle."""

from __future__ import annotations

import signal
import threading
from collections.abc import Mapping

from hpc_ddp.runtime.config import PreemptConfig
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.place.slurm import ask_slurm, job_allows_requeue, queue_job_id, quoted


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


#: The warning signal of the job script's ``#SBATCH --signal`` (the templates export it).
JOB_SIGNAL_VARIABLE = "HPC_DDP_JOB_SIGNAL"


def check_job_signal(environ: Mapping[str, str], warning_signal: str) -> None:
    """Refuse to start when the job script asks Slurm for one warning signal and the ranks
    handle another: at the time limit it would kill them instead of stopping them."""
    declared = environ.get(JOB_SIGNAL_VARIABLE, "").strip()
    job_signal = declared.upper().removeprefix("B:").split("@")[0].removeprefix("SIG")
    if not declared or job_signal == warning_signal:
        return
    raise HpcDdpError(
        f"the job's warning signal is {quoted(job_signal)} (#SBATCH --signal, "
        f"${JOB_SIGNAL_VARIABLE}) but the ranks handle preempt.signal={warning_signal}: at the "
        "time limit it would kill them instead of stopping them with a checkpoint",
        f"make the two equal: `hpc-ddp render ... preempt.signal={warning_signal}` writes "
        f"--signal={warning_signal}@120 (or set preempt.signal to the job's signal)",
    )


def _requeue_outliving_its_sigterm(target: str, timeout_s: float) -> str | None:
    """``scontrol requeue``; None when it worked. Slurm sends the step SIGTERM as the requeue
    ends it, which would kill scontrol before it reports: it starts with SIGTERM ignored (the
    requeue's own SIGTERM to this rank, while it waits, is then ignored too)."""
    if threading.current_thread() is not threading.main_thread():
        return ask_slurm(["scontrol", "requeue", target], timeout_s).failure
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        return ask_slurm(["scontrol", "requeue", target], timeout_s).failure
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def requeue_job(environ: Mapping[str, str], restart_count: int, config: PreemptConfig) -> bool:
    """Rank 0: requeue this Slurm job if allowed and within budget. True if it was requeued."""
    log = get_logger()
    target = queue_job_id(environ)  # an array task as <array id>_<task id>
    if not config.requeue or target is None:
        log.info("not requeueing: " + ("preempt.requeue=false" if target else "not a Slurm job"))
        return False
    if restart_count >= config.max_requeues:
        log.warning(
            f"not requeueing: the job was already requeued {restart_count} time(s), "
            f"preempt.max_requeues={config.max_requeues}"
        )
        return False
    if not job_allows_requeue(target, config.requeue_timeout_s):
        log.warning(f"not requeueing: job {target} does not allow requeue (submit with --requeue)")
        return False
    failure = _requeue_outliving_its_sigterm(target, config.requeue_timeout_s)
    if failure is not None:
        log.error(f"scontrol requeue {target} failed: {failure}")
        return False
    log.info(
        f"requeued job {target} (the job's requeue {restart_count + 1} of at most "
        f"{config.max_requeues}, preempt.max_requeues)"
    )
    return True
