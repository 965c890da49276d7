"""Each rank's printed lines whole and labelled, under ``hpc-ddp local``.

With several ranks writing to one terminal, an unbuffered ``print`` (``PYTHONUNBUFFERED``,
common in clusters' and containers' environments) writes its text and its newline
separately, so two ranks' lines can end up glued into one. :class:`LabelledLines` holds a
rank's standard output until a line is whole and writes it in one call, on a terminal after
the rank's label, as torchrun's own prefixing does. The toolkit's log lines carry the rank
already.

One call is not enough for a long line: a pipe takes a write whole only up to 4 KB
(PIPE_BUF), and a longer one that meets a full pipe goes in pieces between which another
rank's line can land. So the ranks take turns through a lock file the launcher makes: each
line goes out whole, at any length.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
from collections.abc import Iterator, Mapping
from typing import TextIO

#: Set by ``hpc-ddp local`` in each rank's environment when it starts several ranks.
PREFIX_VAR = "HPC_DDP_OUTPUT_PREFIX"
#: The lock file through which those ranks take turns to write a line (see above).
LOCK_VAR = "HPC_DDP_OUTPUT_LOCK"


class LabelledLines(io.TextIOBase):
    """A text stream writing whole lines to ``stream``, each after ``label``; a partial line
    is written when flushed (``print(..., end="", flush=True)``), the label once; another
    rank's line may then go on after it."""

    def __init__(self, stream: TextIO, label: str, lock_path: str | None = None) -> None:
        super().__init__()
        self.stream = stream
        self.label = label
        #: The ranks' shared lock file (None: no other writer to take turns with).
        self.lock_path = lock_path
        self._lock: tuple[int, int] | None = None  # (pid, descriptor) of this process's
        self._pending = ""
        self._mid_line = False  # a flushed partial line is out: no label before the rest

    def _lock_descriptor(self) -> int | None:
        """This process's own descriptor of the lock file: a forked child (a DataLoader
        worker that prints) opens its own, as locks taken through one shared descriptor do
        not exclude each other. None when there is no lock file to open."""
        if self.lock_path is None:
            return None
        if self._lock is None or self._lock[0] != os.getpid():
            try:
                self._lock = (os.getpid(), os.open(self.lock_path, os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                self.lock_path = None  # gone (the launcher ended): lines go out as they come
                return None
        return self._lock[1]

    @contextlib.contextmanager
    def _turn_to_write(self) -> Iterator[None]:
        """No other rank's line goes out meanwhile."""
        lock = self._lock_descriptor()
        if lock is None:
            yield
            return
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)

    def _write_whole(self, text: str) -> None:
        with self._turn_to_write():
            self.stream.write(text)
            self.stream.flush()

    def write(self, text: str) -> int:
        self._pending += text
        if "\n" in self._pending:
            whole, _, self._pending = self._pending.rpartition("\n")
            lines = whole.split("\n")
            first = lines[0] if self._mid_line else self.label + lines[0]
            rest = "".join(f"\n{self.label}{line}" for line in lines[1:])
            self._write_whole(first + rest + "\n")
            self._mid_line = False
        return len(text)

    def flush(self) -> None:
        if self._pending:
            label = "" if self._mid_line else self.label
            self._write_whole(label + self._pending)
            self._pending, self._mid_line = "", True
        else:
            self.stream.flush()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.stream.encoding


def labelled_stdout(stdout: TextIO, environ: Mapping[str, str]) -> TextIO:
    """``stdout`` in whole lines when :data:`PREFIX_VAR` is set, labelled on a terminal
    (a pipe or a file gets the lines as printed, for the programs that read them), one rank
    at a time (:data:`LOCK_VAR`); as it is when unset."""
    label = environ.get(PREFIX_VAR)
    if label is None:
        return stdout
    lines = LabelledLines(stdout, label if stdout.isatty() else "", environ.get(LOCK_VAR) or None)
    return lines  # type: ignore[return-value]
