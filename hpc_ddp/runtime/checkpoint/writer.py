"""This rank's part in writing folder checkpoints: at once, or in the background while
training goes on, one save at a time."""

from __future__ import annotations

import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.checkpoint.files import prune_older, unwritable
from hpc_ddp.runtime.checkpoint.sharded import is_complete, start_writing, write_folder
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.logs import get_logger


@dataclass(frozen=True)
class Pending:
    """A save being written in the background."""

    future: Future[Any]
    folder: Path
    step: int
    reason: str
    started: float


class FolderSaves:
    """Writes ``step-N/`` folders in ``directory`` on ``group`` (every rank calls each
    method). A background save must be waited for before the next save, a stop or the end:
    :meth:`write` and :meth:`wait` do."""

    def __init__(self, directory: Path, keep_last: int, group: Any | None, is_main: bool) -> None:
        self.directory = directory
        self.keep_last = keep_last
        self.group = group
        self.is_main = is_main
        self.pending: Pending | None = None
        #: Seconds from the start of the last finished save to its commit (None: none yet).
        self.last_write_s: float | None = None

    def write(self, state: dict[str, Any], step: int, reason: str, background: bool) -> None:
        """Save ``state`` as step ``step``; ``background``: return once it is copied."""
        self.wait()
        folder = self.directory / f"step-{step:09d}"
        started = time.perf_counter()
        try:
            if background:
                future = start_writing(state, folder, self.group)
                self.pending = Pending(future, folder, step, reason, started)
                return
            write_folder(state, folder, self.group)
        except Exception as error:
            raise self._refusal(folder, error) from None
        self._committed(folder, step, reason, started)

    def wait(self) -> None:
        """Until the background save (if any) is on disk, ``.metadata`` included."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.future.result()
        except Exception as error:
            raise self._refusal(pending.folder, error) from None
        self._committed(pending.folder, pending.step, pending.reason, pending.started)

    def _committed(self, folder: Path, step: int, reason: str, started: float) -> None:
        self.last_write_s = time.perf_counter() - started
        if self.is_main:
            prune_older(self.directory, step, self.keep_last)
            get_logger().info(
                f"checkpoint ({reason}) step {step}: {folder} ({self.last_write_s:.2f} s)"
            )

    def _refusal(self, folder: Path, error: Exception) -> HpcDdpError:
        """The failure of a save on any rank, as every rank reports it; rank 0 removes what
        was written of it (it is no checkpoint, and it takes space)."""
        if self.is_main and not is_complete(folder):
            shutil.rmtree(folder, ignore_errors=True)
        if isinstance(error, HpcDdpError):
            return error
        cause = _first_cause(error)
        if isinstance(cause, OSError | RuntimeError):
            return unwritable(folder, cause)
        return HpcDdpError(
            f"cannot write checkpoint {folder}: {type(cause).__name__}: {cause}",
            "the previous checkpoint is kept; fix the cause, then run the same command again "
            "to resume from it",
        )


def _first_cause(error: BaseException) -> BaseException:
    """The first rank's own exception inside torch's CheckpointException, else ``error``."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        if isinstance(first, BaseException):
            return first
        if isinstance(first, tuple) and first and isinstance(first[0], BaseException):
            return first[0]
    return error
