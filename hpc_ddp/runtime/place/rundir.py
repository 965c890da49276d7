"""The run directory: a plain name under output_dir, writable, and held by one live run.

Rank 0 claims it before joining the process group: it creates the directory (refusing, with
the reason, one that cannot be created or written), then holds an exclusive lock on
``<run dir>/.lock`` for the rest of the process, so a second run with the same id refuses to
start, naming the host and pid of the first. The lock is the kernel's (flock), so it is gone
the moment the holding process is, however it ended.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import socket
from pathlib import Path
from typing import IO

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.safefiles import make_dirs, open_lock_file

LOCK_FILE = ".lock"
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,199}")
#: The claimed directories' lock files, open for the life of the process.
_HELD: dict[Path, IO[str]] = {}


def check_plain_name(value: str, key: str) -> str:
    """``value`` if it can name one folder (no path separators, not . or ..)."""
    if not _PLAIN_NAME.fullmatch(value):
        raise HpcDdpError(
            f"{key}={value!r} cannot name a run folder: it must be one plain name",
            f"use letters, digits, '.', '_', '+' and '-', starting with a letter or digit "
            f"(e.g. {key}=exp-3); put folders in run.output_dir",
        )
    return value


def check_creatable(run_dir: Path) -> None:
    """Refuse a run directory that could not be created or written, without creating it:
    its nearest existing ancestor must be a directory this process may write."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
        return
    reason = "is not a directory" if not existing.is_dir() else "is not writable"
    raise HpcDdpError(
        f"cannot create or write the run directory {run_dir}: {existing} {reason}",
        "set run.output_dir to a directory this job can write (every node must see it)",
    )


def check_owned(run_dir: Path) -> None:
    """Refuse a run directory another user owns: they could read or replace its files."""
    owner = run_dir.stat().st_uid
    if owner != os.getuid():
        raise HpcDdpError(
            f"run directory {run_dir} belongs to another user (uid {owner}, this job runs as "
            f"uid {os.getuid()})",
            "give the run another run.id, or set run.output_dir to a folder of your own",
        )


def claim_run_dir(run_dir: Path) -> None:
    """Create ``run_dir`` and hold its lock for this process (HpcDdpError if another live
    run holds it, or if it cannot be created or written)."""
    if run_dir in _HELD:
        return
    try:
        make_dirs(run_dir)
        check_owned(run_dir)
        handle = open_lock_file(run_dir / LOCK_FILE)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise HpcDdpError(
                f"{run_dir / LOCK_FILE} is a link: the run would write through it to another file",
                "remove it (someone else may have planted it), or give the run another run.id",
            ) from None
        raise HpcDdpError(
            f"cannot create or write the run directory {run_dir}: {error.strerror or error}",
            "set run.output_dir to a directory this job can write (every node must see it)",
        ) from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno not in (errno.EAGAIN, errno.EACCES):
            # Some parallel file systems are mounted without locks (Lustre's noflock): run
            # unguarded rather than not at all.
            from hpc_ddp.runtime.logs import get_logger

            get_logger().warning(
                f"cannot lock the run directory {run_dir} ({error.strerror or error}): a "
                "second run with the same run.id would not be refused. HINT: mount the file "
                "system with locks (e.g. Lustre's -o flock) or keep run ids unique"
            )
            _HELD[run_dir] = handle
            return
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise HpcDdpError(
            f"run directory {run_dir} is in use by a live run ({holder})",
            "wait for it to end, or give this run another run.id",
        ) from None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"host {socket.gethostname()} pid {os.getpid()}\n")
        handle.flush()
    except OSError as error:  # a full disk or quota: the run could write nothing there
        with contextlib.suppress(OSError):
            handle.close()  # its flush fails again; the file is closed all the same
        raise HpcDdpError(
            f"cannot write {run_dir / LOCK_FILE}: {error.strerror or error}",
            "free space or quota on that file system (df -h, quota -s), or set "
            "run.output_dir to a folder on another",
        ) from None
    _HELD[run_dir] = handle
