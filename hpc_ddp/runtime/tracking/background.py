"""Rank 0's record files written by one background thread, in the order they were asked for.

Rank 0 writes its record (a metrics line, status.json) at every log interval. On a shared
file system (NFS, Lustre) creating and renaming a file can take milliseconds or, on a loaded
metadata server, far longer; done on the training thread, every other rank would wait that
long at the next collective. Handed to this thread, the write delays only the record.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

from hpc_ddp.runtime.errors import error_line
from hpc_ddp.runtime.logs import get_logger

#: At the interpreter's exit, how long the writes still queued may take (a hung mount must
#: not hold the process).
EXIT_WAIT_S = 10.0
#: A writer thread with nothing to write for this long ends (a later write starts another):
#: a process that runs many runs keeps no thread, and no tracker, per finished one.
IDLE_EXIT_S = 30.0

_LIVE: weakref.WeakSet[BackgroundWrites] = weakref.WeakSet()


class BackgroundWrites:
    """Writes run on a daemon thread, started with the first, in the order submitted.

    A write handles its own file errors; anything else it raises is said as a warning, and
    the writes after it still run."""

    def __init__(
        self,
        name: str = "hpc-ddp-record",
        idle_exit_s: float = IDLE_EXIT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._name = name
        self._idle_exit_s = idle_exit_s
        self._clock = clock
        #: (when it was submitted, the write), oldest first.
        self._queued: deque[tuple[float, Callable[[], None]]] = deque()
        self._changed = threading.Condition()
        self._writing_since: float | None = None
        self._thread: threading.Thread | None = None
        _LIVE.add(self)

    def submit(self, write: Callable[[], None]) -> None:
        """Queue ``write``; never waits for the file system."""
        with self._changed:
            self._queued.append((self._clock(), write))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every write submitted so far is done, at most ``timeout_s``; whether
        they all were."""
        with self._changed:
            return self._changed.wait_for(self._idle, timeout_s)

    def waiting_s(self) -> float:
        """How long the oldest write not yet done has waited (0: none)."""
        with self._changed:
            oldest = self._writing_since
            if oldest is None and self._queued:
                oldest = self._queued[0][0]
        return 0.0 if oldest is None else self._clock() - oldest

    def forget_parent(self) -> None:
        """In a forked child: none of the parent's writes, thread or lock."""
        self._changed = threading.Condition()
        self._queued.clear()
        self._writing_since, self._thread = None, None

    def _idle(self) -> bool:
        return not self._queued and self._writing_since is None

    def _work(self) -> None:
        while True:
            with self._changed:
                if not self._changed.wait_for(lambda: bool(self._queued), self._idle_exit_s):
                    self._thread = None
                    return
                self._writing_since, write = self._queued.popleft()
            try:
                write()
            except Exception as error:
                get_logger().warning(f"a write of the run's record failed: {error_line(error)}")
            finally:
                del write  # holds its tracker: not kept while waiting for the next
                with self._changed:
                    self._writing_since = None
                    self._changed.notify_all()


@atexit.register
def _drain_at_exit() -> None:
    """A script that ends without ``run.finish()`` still leaves its record whole."""
    for writes in list(_LIVE):
        writes.drain(EXIT_WAIT_S)


def _forget_in_child() -> None:
    """A child forked from rank 0 (a user's helper process) has no writer thread: its exit
    must not wait for writes that are its parent's, and a write of its own starts its own."""
    for writes in list(_LIVE):
        writes.forget_parent()
    _LIVE.clear()


os.register_at_fork(after_in_child=_forget_in_child)
