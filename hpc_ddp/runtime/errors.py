"""The exceptions users see, and the exit codes every entry point uses.

Standard library only: importing this costs nothing before torch.
"""

from __future__ import annotations

#: A crash: the rank's traceback is printed.
EXIT_FAILURE = 1
#: A problem with the input or the launch: a message with a HINT, no traceback.
EXIT_USER_ERROR = 2
#: Stopped on a signal after a checkpoint, and not requeued: run again to continue (with
#: checkpoint.enabled=false: stopped without one, and a run again starts from step 0).
EXIT_STOPPED = 3
#: A collective failed because another rank went away: a consequence; that rank's own
#: output shows the cause.
EXIT_PEER_LOST = 4
#: No training step finished for ``dist.stall_timeout_s``: the rank wrote its threads'
#: stacks to its log and ended the job (:mod:`hpc_ddp.runtime.preempt.watchdog`).
EXIT_STALLED = 5
#: Hosts failed the checks ``preempt.max_node_failures`` times: the job is not requeued
#: again, and the line names every host it left out.
EXIT_NODES_FAILED = 6
#: The job's last ``preempt.max_attempts_without_progress`` attempts ended without moving
#: the checkpoint forward: it ends instead of training again.
EXIT_NO_PROGRESS = 7
#: The rank's device failed (an uncorrectable ECC error, a GPU gone from the bus, NCCL's
#: system error): the batch script of slurm/train.sh then leaves the rank's host out of the
#: job and requeues it, as for a rank killed by a signal it did not ask for.
EXIT_DEVICE_ERROR = 8

#: What CUDA and NCCL say when the hardware, not the program, failed. An illegal memory
#: access, a device-side assert or an unspecified launch failure is left out (most often a
#: kernel of the program's own), and so is NCCL's system error (most often a setting that
#: fails alike on every host).
DEVICE_ERROR_MARKERS = (
    "uncorrectable ECC error",
    "ECC error encountered",
    "GPU has fallen off the bus",
    "CUDA-capable device(s) is/are busy or unavailable",
    "unhandled cuda error",
    "ncclUnhandledCudaError",
)

#: torch's words for an operation with no deterministic kernel under run.deterministic.
NO_DETERMINISTIC_KERNEL = "does not have a deterministic implementation"

#: What gloo and NCCL say when the other end of a collective has gone (crashed, killed).
PEER_LOST_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote process exited or there was a network error",
)
#: What a rank that only waited for a lost or stuck peer says: besides the markers above,
#: the process groups' own names and their timeouts. Such a failure is shown after the root
#: cause when several ranks failed.
CONSEQUENTIAL_FAILURE_MARKERS = (
    *PEER_LOST_MARKERS,
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "timed out",
    "Timed out",
    "NCCL communicator was aborted",
)


def message_of(error: BaseException) -> str:
    """``str(error)``; "" where the exception's own ``__str__`` fails (it is the user's)."""
    try:
        return str(error)
    except Exception:
        return ""


def _line_with(error: BaseException, markers: tuple[str, ...]) -> str | None:
    """The first line of ``error`` (or of an exception it came from) holding one of
    ``markers``, or None."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for line in message_of(current).splitlines():
            if any(marker in line for marker in markers):
                return line
        current = current.__cause__ or current.__context__
    return None


def lost_peer(error: BaseException) -> str | None:
    """The line of ``error`` (or of an exception it came from) that says another rank went
    away, or None."""
    return _line_with(error, PEER_LOST_MARKERS)


def no_deterministic_kernel(error: BaseException) -> str | None:
    """torch's line (in ``error`` or an exception it came from) for an operation with no
    deterministic kernel under run.deterministic, or None."""
    return _line_with(error, (NO_DETERMINISTIC_KERNEL,))


def device_failure(error: BaseException) -> str | None:
    """The line of ``error`` (or of an exception it came from) that says this rank's device
    or its link failed, or None."""
    return _line_with(error, DEVICE_ERROR_MARKERS)


class HpcDdpError(Exception):
    """A problem with the user's input or environment that the user can fix.

    The entry points print it as ``error: <message>`` followed by ``HINT: <hint>`` and exit
    with ``exit_code`` (2), without a traceback. One that ``same_on_every_rank`` (a setting
    every rank read alike) is printed by each host's first rank.
    """

    def __init__(
        self,
        message: str,
        hint: str = "",
        exit_code: int = EXIT_USER_ERROR,
        same_on_every_rank: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.exit_code = exit_code
        self.same_on_every_rank = same_on_every_rank

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message}\nHINT: {self.hint}"
        return self.message


class Stopped(SystemExit):
    """Raised from :meth:`hpc_ddp.Run.steps` when the ranks stopped on a signal.

    By then every rank has stopped after the same step, the checkpoint is written
    (``checkpointed``; False with checkpoint.enabled=false, when the job is not requeued
    either), the job was requeued if that was asked for and allowed, and the process group
    is gone. As a :class:`SystemExit` it ends the script with :attr:`code`: 0 when the job
    was requeued (Slurm starts it again and it resumes), ``EXIT_STOPPED`` (3) when it was not.
    """

    def __init__(self, step: int, requeued: bool, run_id: str, checkpointed: bool = True) -> None:
        super().__init__(0 if requeued else EXIT_STOPPED)
        self.step = step
        self.requeued = requeued
        self.run_id = run_id
        self.checkpointed = checkpointed


class AlreadyFinished(SystemExit):
    """Raised from :meth:`hpc_ddp.Run.epochs` when the run resumed from the checkpoint its
    finished training ended with and there is nothing left to train (the same epochs as
    before). Its files (summary.json, checkpoints, its MLflow run) are left as they were; the
    script ends with code 0. More epochs continue the run instead."""

    def __init__(self, step: int, run_dir: str) -> None:
        super().__init__(0)
        self.step = step
        self.run_dir = run_dir


def error_line(error: BaseException, limit: int = 300) -> str:
    """``error`` in one line for a message: its type and the first line of its text."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:limit]}" if lines else type(error).__name__
