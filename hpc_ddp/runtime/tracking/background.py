"""Rank 0's record files written by one background thread, in the order they were asked for.

Rank 0 writes its record (a metrics line, status.json) at every log interval. On a shared
file system (NFS, Lustre) creating and renaming a file can take milliseconds or, on a loaded
metadata server, far longer; done on the training thread, every other rank would wait that
long at the next collective. Handed to this thread, the write delays only the record.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections import deque
from collections.abc import Callable

from hpc_ddp.runtime.errors import error_line
from hpc_ddp.runtime.logs import get_logger

#: At the interpreter's exit, how long the writes still queued may take (a hung mount must
#: not hold the process).
EXIT_WAIT_S = 10.0

_LIVE: weakref.WeakSet[BackgroundWrites] = weakref.WeakSet()


class BackgroundWrites:
    """Writes run on one daemon thread, started with the first, in the order submitted.

    A write handles its own file errors; anything else it raises is said as a warning, and
    the writes after it still run."""

    def __init__(self, name: str = "hpc-ddp-record") -> None:
        self._name = name
        self._queued: deque[Callable[[], None]] = deque()
        self._changed = threading.Condition()
        self._writing = False
        self._thread: threading.Thread | None = None
        _LIVE.add(self)

    def submit(self, write: Callable[[], None]) -> None:
        """Queue ``write``; never waits for the file system."""
        with self._changed:
            self._queued.append(write)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every write submitted so far is done, at most ``timeout_s``; whether
        they all were."""
        with self._changed:
            return self._changed.wait_for(self._idle, timeout_s)

    def _idle(self) -> bool:
        return not self._queued and not self._writing

    def _work(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._queued))
                write = self._queued.popleft()
                self._writing = True
            try:
                write()
            except Exception as error:
                get_logger().warning(f"a write of the run's record failed: {error_line(error)}")
            finally:
                with self._changed:
                    self._writing = False
                    self._changed.notify_all()


@atexit.register
def _drain_at_exit() -> None:
    """A script that ends without ``run.finish()`` still leaves its record whole."""
    for writes in list(_LIVE):
        writes.drain(EXIT_WAIT_S)
