"""A SHA-256 beside each data file of a folder checkpoint, so that a file changed after it
was written (a bit flip on disk or in a copy, a shard taken from another run) is found
before its bytes are loaded: DCP itself checks nothing, and a changed tensor loads silently.

Each writing rank hashes the files it wrote before ``.metadata`` commits the folder, into
``NAME.sha256`` in the format of ``sha256sum``, so ``sha256sum -c *.sha256`` inside the
folder checks it by hand too.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

#: What follows a data file's name in the name of its checksum file.
SUFFIX = ".sha256"
_CHUNK = 8 << 20
#: Files hashed at once when a folder is checked.
HASHING_THREADS = 8


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_checksums(folder: Path, names: Iterable[str]) -> None:
    """``NAME.sha256`` for each file ``names`` names in ``folder`` (written and on disk)."""
    for name in sorted(set(names)):
        line = f"{file_sha256(folder / name)}  {name}\n".encode()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        descriptor = os.open(folder / f"{name}{SUFFIX}", flags, 0o644)
        try:
            os.write(descriptor, line)
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def check_checksums(folder: Path, names: Iterable[str]) -> None:
    """Raises ValueError when a file ``names`` names differs from its checksum, or has none
    while others of the folder have one. A folder without any (written before checksums
    were kept) is taken as it is."""
    wanted = sorted(set(names))
    kept = {name: folder / f"{name}{SUFFIX}" for name in wanted}
    if not any(path.is_file() for path in kept.values()):
        return
    recorded: dict[str, str] = {}
    for name, path in kept.items():
        try:
            recorded[name] = path.read_text(encoding="ascii", errors="replace").split(" ", 1)[0]
        except FileNotFoundError:
            raise ValueError(f"{name} has no checksum, while the folder's other files do") from None
    # The files of every rank, read by one process: hashed side by side (hashlib and file
    # reads let go of the GIL), so a large checkpoint takes its disk's time, not one core's.
    workers = max(1, min(HASHING_THREADS, len(wanted), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        digests = pool.map(lambda name: file_sha256(folder / name), wanted)
        found = dict(zip(wanted, digests, strict=True))
    for name, path in kept.items():
        if found[name] != recorded[name]:
            raise ValueError(
                f"{name} does not match its checksum ({path.name}): it changed after it was "
                "written (damaged on disk or in a copy, or a file of another checkpoint)"
            )
