"""Holds for the test programs: after a given step, each rank says
``HOLDING at step N (rank r)`` on stderr and waits until a stop signal reached it (so a
signal sent on that line lands at a known step however fast the machine trains; hpc_ddp's
own handlers still get every signal, first), or until the test made a file."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

#: The stop signals a rank may be sent: the job's warnings, SIGTERM, Ctrl-C.
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
#: How long a rank holds before it gives up on the signal, saying so.
HOLD_LIMIT_S = 300


class StopSignalSeen:
    """Whether a stop signal reached this process; made after ``hpc_ddp.start`` (which
    installs the handlers this passes each signal on to)."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        for number in STOP_SIGNALS:
            handler = signal.getsignal(number)
            if callable(handler):
                signal.signal(number, self._passing_to(handler))

    def _passing_to(self, handler: Any) -> Any:
        def seen(number: int, frame: FrameType | None) -> None:
            self.seen.append(number)
            handler(number, frame)

        return seen

    def hold(
        self,
        rank: int,
        step: int,
        wanted: tuple[signal.Signals, ...] = STOP_SIGNALS,
        count: int = 1,
    ) -> None:
        """Wait here until ``count`` of the ``wanted`` stop signals came (at most
        HOLD_LIMIT_S, then exit saying so); after the first of two, say ``HELD for a second
        stop signal (rank r)``."""
        print(f"HOLDING at step {step} (rank {rank})", file=sys.stderr, flush=True)
        deadline = time.monotonic() + HOLD_LIMIT_S
        said_first = False
        while (arrived := len([n for n in self.seen if n in wanted])) < count:
            if arrived and not said_first:
                said_first = True
                print(f"HELD for a second stop signal (rank {rank})", file=sys.stderr, flush=True)
            if time.monotonic() > deadline:
                sys.exit(f"rank {rank} held at step {step} for {HOLD_LIMIT_S} s: no stop signal")
            time.sleep(0.01)


class FileAppears:
    """A hold that ends when the test creates ``path`` (the test acts on the run meanwhile:
    kills a server it talks to, starts a second run beside it)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def hold(self, rank: int, step: int) -> None:
        """Wait here until ``path`` exists (at most HOLD_LIMIT_S, then exit saying so)."""
        print(f"HOLDING at step {step} (rank {rank})", file=sys.stderr, flush=True)
        deadline = time.monotonic() + HOLD_LIMIT_S
        while not self.path.exists():
            if time.monotonic() > deadline:
                sys.exit(f"rank {rank} held at step {step} for {HOLD_LIMIT_S} s: no {self.path}")
            time.sleep(0.01)
