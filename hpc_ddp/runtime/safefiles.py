"""Files in a run directory, written without following a link planted there and without
group or world write, whatever the umask: run directories sit in shared project folders,
and their names (job ids) are predictable."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import IO, Any

from hpc_ddp.runtime.errors import HpcDdpError

#: New files: the owner writes, others may read (less where the umask says less).
FILE_MODE = 0o644
#: New folders: the same for folders.
DIR_MODE = 0o755
_NEW = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def make_dirs(path: Path) -> None:
    """``path`` and its missing parents, each made with :data:`DIR_MODE`."""
    missing = []
    while not path.exists() and not path.is_symlink() and path != path.parent:
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another rank or run
            folder.mkdir(mode=DIR_MODE)


def folder_made(folder: Path, what: str, hint: str) -> Path:
    """``folder`` made with its parents (kept where it exists), or the error a person
    reads: ``what`` the folder is to them, why it cannot be made, and ``hint``."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise HpcDdpError(f"cannot create {what} {folder}: {error.strerror}", hint) from None
    return folder


def create_temporary(directory: Path, prefix: str) -> tuple[Path, int]:
    """A new file in ``directory`` under an unguessable name starting with ``prefix``,
    created exclusively (never through an existing name or link): (its path, an fd open
    for writing)."""
    path = directory / f"{prefix}{secrets.token_hex(6)}"
    return path, os.open(path, _NEW | os.O_WRONLY, FILE_MODE)


def replace_bytes(path: Path, data: bytes) -> None:
    """Put ``data`` at ``path`` so that readers see the old file or the new one whole; a link
    planted at ``path`` is replaced, never written through."""
    temporary, descriptor = create_temporary(path.parent, f".{path.name}.tmp-")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def read_records(path: Path, key: str) -> list[dict[str, Any]]:
    """The JSON list of records in ``path`` that hold ``key``, in order; [] when the file is
    missing, unreadable or not a list (a record is best effort, never a reason to stop)."""
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(records, list):
        return []
    return [record for record in records if isinstance(record, dict) and key in record]


def write_records(path: Path, records: list[Any]) -> None:
    """Replace ``path`` with ``records`` as an indented JSON list."""
    replace_bytes(path, (json.dumps(records, indent=1) + "\n").encode())


def open_append(path: Path) -> IO[str]:
    """``path`` for appending text; refused (OSError) when a link stands there."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, FILE_MODE), "a")


def open_lock_file(path: Path) -> IO[str]:
    """``path`` for reading and writing, created if missing; refused (OSError) when a link
    stands there."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, FILE_MODE), "r+")
