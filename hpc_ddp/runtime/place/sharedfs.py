"""Whether every rank sees the run directory rank 0 made: the ranks of a job write one
checkpoint together, so a run directory on a disk of each node's own (``/tmp``, a local
scratch, a relative ``output_dir`` resolved in other working directories) would split every
checkpoint between hosts, and no resume could read it. Found at the start, in one small
file and two collectives, instead of at the first resume."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.place.dist import all_gather_object, broadcast_object

#: The start of the name of the file rank 0 leaves for the others to read.
MARK_PREFIX = ".seen-by-every-rank-"


def leave_mark(run_dir: Path) -> str:
    """A file of a new name in ``run_dir`` (never looked up before, so no host's cache of
    names can hide it) holding that name; returns the name."""
    name = f"{MARK_PREFIX}{secrets.token_hex(8)}"
    descriptor = os.open(run_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(descriptor, name.encode())
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    return name


def mark_unseen(run_dir: Path, name: str) -> str | None:
    """Why this host does not see rank 0's mark ``name`` in ``run_dir``, or None."""
    try:
        found = (run_dir / name).read_bytes()
    except OSError as error:
        return f"{socket.gethostname()} ({_working_directory()}): {error.strerror or error}"
    if found != name.encode():
        return f"{socket.gethostname()}: {run_dir / name} holds {found[:40]!r}"
    return None


def failed_ranks(failures: list[str | None], shown: int = 3) -> tuple[int, str]:
    """How many of the ranks' ``failures`` (each rank's reason, None where it did not fail)
    are failures, and the first ``shown`` of them in words."""
    failed = [(rank, reason) for rank, reason in enumerate(failures) if reason]
    return len(failed), "; ".join(f"rank {rank} on {reason}" for rank, reason in failed[:shown])


def _working_directory() -> str:
    try:
        return os.getcwd()
    except OSError:  # removed under this process
        return os.environ.get("PWD", "?") + " (removed)"


def refuse_unless_seen(run_dir: Path, failures: list[str | None]) -> None:
    """One line on every rank when some ranks (``failures``: each rank's reason, None where
    it saw the mark) do not see the run directory rank 0 made."""
    count, listed = failed_ranks(failures)
    if not count:
        return
    raise HpcDdpError(
        f"the run directory {run_dir} that rank 0 made is not seen by {count} of "
        f"{len(failures)} ranks ({listed}): their checkpoints would be split between hosts",
        "set run.output_dir to an absolute path on a file system every node mounts (a "
        "shared home or project space, not /tmp or a node-local disk)",
    )


def check_every_rank_sees(run_dir: Path, rank: int, group: Any) -> None:
    """Refuses, on every rank, a run directory that not every rank sees as rank 0 does (a
    collective on ``group``; nothing to check for one rank)."""
    if group is None:
        return
    name, refusal = "", None
    if rank == 0:
        try:
            name = leave_mark(run_dir)
        except OSError as error:
            refusal = f"cannot write in the run directory {run_dir}: {error.strerror or error}"
    name, refusal = broadcast_object((name, refusal), group)
    if refusal is not None:
        raise HpcDdpError(refusal, "free space there, or set run.output_dir to another folder")
    failures = all_gather_object(mark_unseen(run_dir, name), group)
    if rank == 0:
        with contextlib.suppress(OSError):  # a leftover is harmless; a crash here is not
            (run_dir / name).unlink(missing_ok=True)
    refuse_unless_seen(run_dir, failures)
