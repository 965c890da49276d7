"""A SHA-256 beside each data file of a folder checkpoint, so that a file changed after it
was written (a bit flip on disk or in a copy, a shard taken from another run) is found
before its bytes are loaded: DCP itself checks nothing, and a changed tensor loads silently.

Each writing rank hashes the bytes of its files as it writes them (:class:`HashingWriter`:
never read back, which on a parallel file system would read them again over the network)
and keeps each file's hash, before ``.metadata`` commits the folder, in ``NAME.sha256`` in
the format of ``sha256sum``, so ``sha256sum -c *.sha256`` inside the folder checks it by
hand too.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

#: What follows a data file's name in the name of its checksum file.
SUFFIX = ".sha256"
_CHUNK = 8 << 20
#: Writes from this size on are hashed beside the write, on a second thread (hashlib and
#: the file's write both release the GIL).
_HASH_BESIDE_FROM = 1 << 20
#: Files hashed at once when a folder is checked.
HASHING_THREADS = 8


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class HashingWriter:
    """A binary file being written, hashed as its bytes pass (everything else is the
    file's own). A large write is hashed on a second thread while it goes to the file, so
    a save takes about the longer of the two, not their sum; ``write`` returns once both
    are done, so the caller's buffer is never read after it."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self._digest = hashlib.sha256()
        self._hasher: ThreadPoolExecutor | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.nbytes < _HASH_BESIDE_FROM:
            self._digest.update(view)
            return self.raw.write(view)
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(1, thread_name_prefix="hpc-ddp-sha256")
        try:
            hashed = self._hasher.submit(self._digest.update, view)
        except RuntimeError:  # the interpreter is exiting (a background save finishing then)
            self._digest.update(view)
            return self.raw.write(view)
        try:
            return self.raw.write(view)
        finally:
            hashed.result()

    def close(self) -> None:
        self.stop_hashing()
        self.raw.close()

    def stop_hashing(self) -> None:
        """Let the hashing thread go (the file's last write is in)."""
        if self._hasher is not None:
            self._hasher.shutdown()
            self._hasher = None

    def hexdigest(self) -> str:
        return self._digest.hexdigest()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


def checksumming_writer(folder: Path) -> FileSystemWriter:
    """DCP's writer of ``folder``, keeping a checksum of each file it writes (hashed as
    written, kept before the coordinator's ``.metadata`` commits the folder)."""
    from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

    class HashingFileSystem(FileSystem):
        def __init__(self) -> None:
            super().__init__()
            self.digests: dict[str, str] = {}
            self._lock = threading.Lock()  # DCP may write several files at once

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
            with super().create_stream(path, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                hashing = HashingWriter(cast(IO[bytes], stream))
                try:
                    yield hashing
                finally:
                    hashing.stop_hashing()
            with self._lock:
                self.digests[Path(path).name] = hashing.hexdigest()

    class ChecksummingWriter(FileSystemWriter):
        def __init__(self) -> None:
            super().__init__(folder, sync_files=True)
            self.hashing = HashingFileSystem()
            self.fs = self.hashing

        def write_data(self, plan: Any, planner: Any) -> Any:
            written = super().write_data(plan, planner)  # a torch.futures.Future, done
            names = {result.storage_data.relative_path for result in written.wait()}
            digests = self.hashing.digests
            write_checksums(folder, {name: digests[name] for name in names})
            return written

    return ChecksummingWriter()


def write_checksums(folder: Path, digests: Mapping[str, str]) -> None:
    """``NAME.sha256`` in ``folder`` for each file of ``digests`` (name: its SHA-256)."""
    for name, digest in sorted(digests.items()):
        line = f"{digest}  {name}\n".encode()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        descriptor = os.open(folder / f"{name}{SUFFIX}", flags, 0o644)
        try:
            os.write(descriptor, line)
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def check_checksums(folder: Path, names: Iterable[str], share: tuple[int, int] = (0, 1)) -> None:
    """Raises ValueError when a file ``names`` names differs from its checksum, or has none
    while others of the folder have one. A folder without any (written before checksums
    were kept) is taken as it is. ``share`` (i, n): only every n-th file from the i-th is
    read and hashed (the ranks share the reading; every one checks that each file has a
    checksum)."""
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
    mine = wanted[share[0] :: share[1]]
    workers = max(1, min(HASHING_THREADS, len(mine), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        digests = pool.map(lambda name: file_sha256(folder / name), mine)
        found = dict(zip(mine, digests, strict=True))
    for name, digest in found.items():
        path = kept[name]
        if digest != recorded[name]:
            raise ValueError(
                f"{name} does not match its checksum ({path.name}): it changed after it was "
                "written (damaged on disk or in a copy, or a file of another checkpoint)"
            )
