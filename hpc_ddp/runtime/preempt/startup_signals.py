"""Stop signals that arrive while a training process is still starting.

Slurm's warning signal (``#SBATCH --signal=USR1@N``), submitit's USR2 and scancel's SIGTERM
can reach a rank while it is still importing torch. Their default action ends the process
at once: no checkpoint, no requeue, and srun reports "User defined signal 1". The training
entry points therefore hold these signals from their first line: a held signal is only
recorded, and when the configured handlers are installed (:meth:`StopSignals.install`) each
recorded signal is raised again and handled as if it had arrived then.

Standard library only, so holding costs nothing before the heavy imports.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

#: Signals whose default action ends a Python process and that a scheduler sends to stop
#: or warn. SIGINT is left alone: Ctrl-C during start-up should interrupt at once.
HELD_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGHUP, signal.SIGALRM)

_held: dict[int, Any] = {}
_arrived: list[int] = []


def _record(signum: int, _frame: FrameType | None) -> None:
    if signum not in _arrived:
        _arrived.append(signum)


def hold_stop_signals() -> None:
    """Record, instead of dying on, any of HELD_SIGNALS until :func:`release_stop_signals`;
    then let them in: the job templates start each rank with them blocked, so one sent
    before this line waits, and is recorded now.

    A signal the parent set to be ignored (nohup's SIGHUP) stays ignored."""
    for signum in HELD_SIGNALS:
        if signum not in _held and signal.getsignal(signum) is signal.SIG_DFL:
            _held[signum] = signal.signal(signum, _record)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)


def release_stop_signals() -> list[int]:
    """Restore the handlers that were there before holding; return the signals that arrived
    meanwhile, each once, in order of arrival (empty when nothing was held)."""
    for signum, previous in _held.items():
        signal.signal(signum, previous)
    _held.clear()
    arrived = list(_arrived)
    _arrived.clear()
    return arrived
