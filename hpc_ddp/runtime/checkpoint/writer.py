"""This rank's part in writing folder checkpoints: at once, or in the background while
training goes on, one save at a time."""

from __future__ import annotations

import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hpc_ddp.runtime.checkpoint.files import prune_older, unwritable, writing_mark
from hpc_ddp.runtime.checkpoint.room import measure_room
from hpc_ddp.runtime.checkpoint.sharded.layout import is_complete
from hpc_ddp.runtime.checkpoint.sharded.writing import (
    new_stager,
    stagers_are_reusable,
    start_writing,
    write_folder,
)
from hpc_ddp.runtime.checkpoint.spread import layout_of, own_share
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.place.dist import same_on_all_ranks, several_ranks
from hpc_ddp.runtime.safefiles import make_dirs


def needs_own_group(world_size: int, background_saves: bool, backend: str) -> bool:
    """Whether background saves need a gloo group of their own: with several ranks (their
    collectives run on a thread of their own, never on a group that training uses), and on
    any other backend at any world size (torch's async_save refuses a default group with no
    CPU backend, as NCCL's is, even at one rank)."""
    return background_saves and (world_size > 1 or backend != "gloo")


@dataclass(frozen=True)
class Pending:
    """A save being written in the background."""

    future: Future[Any]
    folder: Path
    step: int
    reason: str
    started: float
    #: When the writer's thread finished (set by the future's callback).
    finished: list[float]


class FolderSaves:
    """Writes ``step-N/`` folders in ``directory`` on ``group`` (every rank calls each
    method). A background save must be waited for before the next save, a stop or the end:
    :meth:`write` and :meth:`wait` do."""

    def __init__(
        self,
        directory: Path,
        keep_last: int,
        group: Any | None,
        is_main: bool,
        measure_room_once: bool = False,
    ) -> None:
        self.directory = directory
        self.keep_last = keep_last
        self.group = group
        self.is_main = is_main
        #: Measure the first checkpoint on disk against the free space (checks.enabled).
        self.measure_room_once = measure_room_once
        self.pending: Pending | None = None
        #: The copier of background saves, kept for its buffers (made at the first one;
        #: never kept where torch empties it after a copy).
        self.stager: Any = None
        #: Seconds from the start of the last finished save to its commit (None: none yet).
        self.last_write_s: float | None = None

    def write(self, state: dict[str, Any], step: int, reason: str, background: bool) -> None:
        """Save ``state`` as step ``step``; ``background``: return once it is copied. A stop's
        or the end's save (not ``background``) is written even when the background save
        before it failed: that failure is logged, and the stop still requeues."""
        try:
            self.wait()
        except HpcDdpError as failed:
            if background:
                raise
            get_logger().error(f"{failed.message}. HINT: {failed.hint}")
        folder = self.directory / f"step-{step:09d}"
        started = time.perf_counter()
        state = self._fresh_folder(folder, state)
        try:
            if background:
                stager = self.stager or new_stager()
                if stagers_are_reusable():
                    self.stager = stager
                future = start_writing(state, folder, self.group, stager)
                finished: list[float] = []
                future.add_done_callback(lambda _done: finished.append(time.perf_counter()))
                self.pending = Pending(future, folder, step, reason, started, finished)
                return
            write_folder(state, folder, self.group)
        except BaseException as error:  # torch's CheckpointException is a BaseException
            if isinstance(error, KeyboardInterrupt | SystemExit):
                raise
            raise self._refusal(folder, error) from None
        self._committed(folder, step, reason, started)

    def wait(self) -> None:
        """Until the background save (if any) is on disk, ``.metadata`` included."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.future.result()
        except BaseException as error:  # torch's CheckpointException is a BaseException
            if isinstance(error, KeyboardInterrupt | SystemExit):
                raise
            raise self._refusal(pending.folder, error) from None
        done = pending.finished[0] if pending.finished else time.perf_counter()
        self._committed(pending.folder, pending.step, pending.reason, pending.started, done)

    def _fresh_folder(self, folder: Path, state: dict[str, Any]) -> dict[str, Any]:
        """An empty ``folder`` made by rank 0 before any rank writes into it, and what of
        ``state`` this rank writes there (see :mod:`.spread`). A folder left at this step
        by an earlier attempt (checkpoint.resume=false) would mix its old .metadata with
        the new files; a link there would be written through. The folder is made without
        group or world write, whatever the umask."""
        if self.is_main:
            if folder.is_symlink() or folder.is_file():
                folder.unlink()
            elif folder.exists():
                shutil.rmtree(folder, ignore_errors=True)
            make_dirs(folder.parent)
            mark = writing_mark(folder)
            mark.unlink(missing_ok=True)
            mark.touch(exist_ok=False)  # never through a link left there
            make_dirs(folder)
        if not several_ranks():
            return state
        # Reduced after rank 0 made the folder: no rank writes into it before that.
        if not same_on_all_ranks(layout_of(state), self.group):
            return state  # the ranks hold different tensors: DCP picks the writers
        return own_share(state, dist.get_rank(), dist.get_world_size())

    def _committed(
        self, folder: Path, step: int, reason: str, started: float, done: float | None = None
    ) -> None:
        self.last_write_s = (done or time.perf_counter()) - started
        if self.is_main:
            _no_shared_write(folder)
            writing_mark(folder).unlink(missing_ok=True)
            prune_older(self.directory, step, self.keep_last)
            get_logger().info(
                f"checkpoint ({reason}) step {step}: {folder} ({self.last_write_s:.2f} s)"
            )
            if self.measure_room_once:
                self.measure_room_once = False
                measure_room(folder, self.keep_last)

    def _refusal(self, folder: Path, error: BaseException) -> HpcDdpError:
        """The failure of a save on any rank, as every rank reports it; rank 0 removes what
        was written of it (it is no checkpoint, and it takes space)."""
        if self.is_main and not is_complete(folder):
            shutil.rmtree(folder, ignore_errors=True)
        if self.is_main:
            writing_mark(folder).unlink(missing_ok=True)
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


def _no_shared_write(folder: Path) -> None:
    """Take group and world write off the files torch wrote (they follow the umask)."""
    for path in folder.iterdir():
        if not path.is_symlink():
            path.chmod(path.stat().st_mode & 0o7755)


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
