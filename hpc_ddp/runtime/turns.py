"""Ranks that share one output take turns to write, so that a long block goes out whole.

A pipe takes a write whole only up to 4 KB (PIPE_BUF): a longer one that meets a full pipe
goes in pieces between which another rank's output can land, and faulthandler writes a
stack in many small pieces. ``hpc-ddp local`` makes a lock file and names it in each rank's
environment (:data:`LOCK_VAR`); a rank holds it while it writes a line or a block.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator

#: The lock file through which the ranks of ``hpc-ddp local`` take turns to write.
LOCK_VAR = "HPC_DDP_OUTPUT_LOCK"


class OutputTurns:
    """Turns on the lock file at ``lock_path`` (None: no other writer, every turn is free)."""

    def __init__(self, lock_path: str | None) -> None:
        self.lock_path = lock_path
        self._opened: tuple[int, int] | None = None  # (pid, descriptor) of this process's

    def _descriptor(self) -> int | None:
        """This process's own descriptor of the lock file: a forked child (a DataLoader
        worker that prints) opens its own, as locks taken through one shared descriptor do
        not exclude each other. None when there is no lock file to open."""
        if self.lock_path is None:
            return None
        if self._opened is None or self._opened[0] != os.getpid():
            try:
                self._opened = (os.getpid(), os.open(self.lock_path, os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                self.lock_path = None  # gone (the launcher ended): output goes out as it comes
                return None
        return self._opened[1]

    @contextlib.contextmanager
    def turn(self, wait_s: float | None = None) -> Iterator[None]:
        """No other rank writes meanwhile. ``wait_s``: write anyway after waiting that long
        for the turn (a stalled rank's last words must not wait on a writer stuck itself)."""
        lock = self._descriptor()
        if lock is None:
            yield
            return
        if not _take(lock, wait_s):
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _take(lock: int, wait_s: float | None) -> bool:
    """Whether the lock on descriptor ``lock`` was taken, within ``wait_s`` if given."""
    if wait_s is None:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return True
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
