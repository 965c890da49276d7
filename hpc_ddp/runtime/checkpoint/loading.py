"""The way back from a checkpoint: which one a run resumes from (rank 0 chooses, the ranks
check its checksums together), what the resume is told, and how the registered objects take
their saved state. The run's own parts (position, metric sums, random streams) come back
through :meth:`hpc_ddp.runtime.loop.checkpointer.Checkpointer.resume`."""

from __future__ import annotations

import contextlib
import functools
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hpc_ddp.runtime.checkpoint.files import (
    Found,
    checkpoint_dir,
    load_checkpoint,
    load_newest,
    remove_partial_writes,
)
from hpc_ddp.runtime.checkpoint.objects import restore_objects, restore_whole_states
from hpc_ddp.runtime.checkpoint.sharded.layout import FolderObjects
from hpc_ddp.runtime.checkpoint.sharded.metadata import check_share
from hpc_ddp.runtime.checkpoint.state import Registry
from hpc_ddp.runtime.errors import HpcDdpError, error_line
from hpc_ddp.runtime.place.dist import all_gather_object, broadcast_object, several_ranks
from hpc_ddp.runtime.place.sharedfs import failed_ranks
from hpc_ddp.runtime.shards import holds_shards


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run resumed from."""

    path: Path
    step: int
    #: How many ranks wrote it.
    world_size: int
    #: Whether it is the checkpoint a finished run ended with.
    finished: bool = False


def find_resume(
    run_dir: Path,
    rank: int,
    group: Any | None,
    start_fresh_if_unreadable: bool = False,
) -> Found | None:
    """The newest good checkpoint of this run: rank 0 chooses, every rank loads the same;
    a refusal (no checkpoint loads) reaches every rank, so each ends with the same line.
    The ranks read and hash each folder rank 0 considers together, each about 1/W of it."""
    directory = checkpoint_dir(run_dir)
    found, refusal = None, None
    if rank == 0:
        verify = functools.partial(_check_together, group=group) if several_ranks() else None
        try:
            unfinished = remove_partial_writes(directory)
            found = load_newest(directory, start_fresh_if_unreadable, unfinished, verify)
        except HpcDdpError as error:
            refusal = (error.message, error.hint)
        except BaseException as error:  # the others wait for rank 0's word: give it, then end
            failed = f"rank 0 failed while choosing the checkpoint: {error_line(error, 200)}"
            with contextlib.suppress(Exception):  # a group already broken: rank 0's error
                broadcast_object((_CHOSEN, "", (failed, "see rank 0's output above")), group)
            raise
        chosen, refusal = broadcast_object(
            (_CHOSEN, str(found[0]) if found else "", refusal), group
        )[1:]
    else:
        chosen, refusal = _check_until_chosen(rank, group)
    if refusal is not None:
        raise HpcDdpError(*refusal)
    if not chosen:
        return None
    path, failure = Path(chosen), None
    if found is None:
        # The ranks checked the files' checksums before rank 0 chose: not read again here.
        try:
            found = path, load_checkpoint(path, rank, verify=False)
        except HpcDdpError as error:
            failure = f"{socket.gethostname()}: {error.message}"
        except BaseException as error:  # torch's CheckpointException is a BaseException
            if isinstance(error, KeyboardInterrupt | SystemExit):
                raise
            # A file this host does not see as rank 0's host does.
            failure = f"{socket.gethostname()}: {error_line(error, 200)}"
    refuse_unless_read_everywhere(path, all_gather_object(failure, group))
    return found


#: What rank 0 sends while it chooses: a folder to check together, or its choice.
_CHECK, _CHOSEN = "check", "chosen"
#: How a rank's share of a folder failed: its bytes differ from their checksums (the folder
#: is damaged: set aside), or it could not be read there (the folder is kept).
_DAMAGED, _UNREAD = "damaged", "unread"


def _check_together(path: Path, group: Any) -> str | None:
    """Rank 0: every rank checks its share of folder ``path``; what found it damaged, or
    None. A share some rank could not read at all ends the run on every rank, the folder
    kept: a file system that rank's host sees otherwise, not a damaged checkpoint."""
    broadcast_object((_CHECK, str(path), None), group)
    results = all_gather_object(_checked_share(path, 0, group), group)
    unread: list[str | None] = [reason if kind == _UNREAD else None for kind, reason in results]
    count, listed = failed_ranks(unread)
    if count:
        raise HpcDdpError(
            f"checkpoint {path}: {count} rank(s) could not read their share of it: {listed}",
            "those hosts do not see the run directory as the others do (a stale or missing "
            "mount), or the file system failed a read: check that it is on a file system "
            "every node mounts, then run the same command again; the checkpoint is kept",
        )
    damaged = [
        f"rank {rank} on {reason}"
        for rank, (kind, reason) in enumerate(results)
        if kind == _DAMAGED
    ]
    return "; ".join(damaged[:3]) if damaged else None


def _check_until_chosen(rank: int, group: Any) -> tuple[str, tuple[str, str] | None]:
    """The other ranks: check each folder rank 0 sends, until it sends its choice."""
    while True:
        sent: tuple[str, str, tuple[str, str] | None] = broadcast_object(("", "", None), group)
        kind, path, refusal = sent
        if kind == _CHOSEN:
            return path, refusal
        all_gather_object(_checked_share(Path(path), rank, group), group)


def _checked_share(path: Path, rank: int, group: Any) -> tuple[str, str]:
    """("", "") when ``rank``'s share of folder ``path`` matches its checksums; else how it
    failed (:data:`_DAMAGED` or :data:`_UNREAD`) and, after this host's name, why."""
    try:
        check_share(path, rank, dist.get_world_size(group) if several_ranks() else 1)
    except ValueError as error:  # what the check found
        return _DAMAGED, f"{socket.gethostname()}: {error}"
    except BaseException as error:  # a file that does not read here
        if isinstance(error, KeyboardInterrupt | SystemExit):
            raise
        return _UNREAD, f"{socket.gethostname()}: {error_line(error, 200)}"
    return "", ""


def refuse_unless_read_everywhere(path: Path, failures: list[str | None]) -> None:
    """Every rank ends with the same line when checkpoint ``path``, which rank 0 chose and
    read (the ranks checked its checksums together), fails to read on other ranks
    (``failures``: each rank's reason, None where it read): their hosts see the file system
    otherwise (a stale or missing mount), so the checkpoint itself is kept, not set aside."""
    count, listed = failed_ranks(failures)
    if not count:
        return
    raise HpcDdpError(
        f"checkpoint {path} read on rank 0 but not on {count} other rank(s): {listed}",
        "those hosts do not see the run directory as rank 0's does: check that it is on a "
        "file system every node mounts (not /tmp or a node-local disk), then run the same "
        "command again; the checkpoint is kept",
    )


def restore_registered(registry: Registry, saved: Any, path: Path) -> None:
    """The registered objects as checkpoint ``path`` holds them (``saved``: its objects, of
    a folder or a single file)."""
    if isinstance(saved, FolderObjects):
        registry.check_names(list(saved.kinds), path)
        restore_objects(registry.objects, saved, path)
    elif any(holds_shards(value) for value in registry.objects.values()):
        registry.check_names(list(saved), path)
        restore_whole_states(registry.objects, saved, path)
    else:
        registry.restore(saved, path)
