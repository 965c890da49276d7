"""Stop signals that arrive after the run ended, up to the process's very last moment.

Slurm sends the job's warning signal (``#SBATCH --signal=USR1@N``) to every process of the
job, and with a time limit ahead it may come after a rank finished: its work is saved, so
the signal must change nothing, not end the finished process with 128+N.

Standard library only: the launcher uses it too, without importing torch.
"""

from __future__ import annotations

import atexit
import signal
from types import FrameType


def ignored_after_the_run(_signum: int, _frame: FrameType | None) -> None:
    """The job's warning signal once the run ended: its work is saved, nothing to do."""


_ignored_after_the_run: set[int] = set()


def _ignore_through_the_exit() -> None:
    """At exit, the signals ignored after the run become SIG_IGN for the kernel.

    The interpreter, as it finalizes, resets every signal with a Python handler to its
    default action: a warning signal arriving in that last moment (Slurm sends it to every
    process of the job, many times with ``--signal``) would end a finished rank with 128+N.
    SIG_IGN is left as it is; at exit it no longer reaches any program started later."""
    for signum in _ignored_after_the_run:
        if signal.getsignal(signum) is ignored_after_the_run:
            signal.signal(signum, signal.SIG_IGN)


def ignore_until_exit(signum: int) -> None:
    """``signum`` does nothing from now on, through this process's exit."""
    _ignored_after_the_run.add(signum)
    signal.signal(signum, ignored_after_the_run)


# Registered on import, before the run's own exit handler (which imports this module first):
# exit handlers run last-registered first, so this one runs after a run ended at exit (a
# script without run.finish()) has put its signals back; one registered then would not run.
atexit.register(_ignore_through_the_exit)
