"""Each rank's printed lines whole and labelled, under ``hpc-ddp local``.

With several ranks writing to one terminal, an unbuffered ``print`` (``PYTHONUNBUFFERED``,
common in clusters' and containers' environments) writes its text and its newline
separately, so two ranks' lines can end up glued into one. :class:`LabelledLines` holds a
rank's standard output until a line is whole and writes it in one call, on a terminal after
the rank's label, as torchrun's own prefixing does. The toolkit's log lines carry the rank
already.

One call is not enough for a long line (see :mod:`hpc_ddp.runtime.turns`): the ranks take
turns through a lock file the launcher makes, so each line goes out whole, at any length.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import TextIO

from hpc_ddp.runtime.turns import LOCK_VAR, OutputTurns

#: Set by ``hpc-ddp local`` in each rank's environment when it starts several ranks.
PREFIX_VAR = "HPC_DDP_OUTPUT_PREFIX"
__all__ = ["LOCK_VAR", "PREFIX_VAR", "LabelledLines", "labelled_stdout"]


class LabelledLines(io.TextIOBase):
    """A text stream writing whole lines to ``stream``, each after ``label``; a partial line
    is written when flushed (``print(..., end="", flush=True)``), the label once; another
    rank's line may then go on after it."""

    def __init__(self, stream: TextIO, label: str, lock_path: str | None = None) -> None:
        super().__init__()
        self.stream = stream
        self.label = label
        #: Turns on the ranks' shared lock file (None: no other writer to take turns with).
        self.turns = OutputTurns(lock_path)
        self._pending = ""
        self._mid_line = False  # a flushed partial line is out: no label before the rest

    def _write_whole(self, text: str) -> None:
        with self.turns.turn():
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
