"""A folder's ``.metadata``: read once while it is the same file, admitting only DCP's own
classes, and the files it names checked (present, long enough, unchanged)."""

from __future__ import annotations

import functools
import pickle
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hpc_ddp.runtime.checkpoint.checksums import check_checksums
from hpc_ddp.runtime.checkpoint.sharded.layout import METADATA

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


def read_metadata(folder: Path) -> Metadata:
    """The folder's ``.metadata``, unpickled once while it is the same file: a resume reads
    it several times (the run blob, the rank's own, the optimizers' saved parameters, the
    tensors), and for a model of many tensors unpickling it is not free."""
    found = (folder / METADATA).stat()
    identity = (found.st_ino, found.st_size, found.st_mtime_ns)  # a new file: read again
    return _metadata_of(str(folder.resolve()), identity)


def forget_metadata() -> None:
    """Let go of the metadata :func:`read_metadata` keeps, once a resume has read it (for
    a large model it holds a lot)."""
    _metadata_of.cache_clear()


@functools.lru_cache(maxsize=1)
def _metadata_of(folder: str, _identity: tuple[int, int, int]) -> Metadata:
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    with open(Path(folder) / METADATA, "rb") as handle:
        metadata = MetadataUnpickler(handle).load()
    if not isinstance(metadata, Metadata):
        raise ValueError(f"its {METADATA} holds a {type(metadata).__name__}, not DCP's Metadata")
    if metadata.storage_meta is None:
        metadata.storage_meta = StorageMeta()
    return metadata


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a ``.metadata`` admitting only the classes DCP writes there (its metadata
    records, torch's sizes, dtypes and layouts, paths): a planted pickle that would run code
    is refused (torch's own reader uses plain pickle)."""

    MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if self._admitted(module, name) else None
        if found is None:
            raise pickle.UnpicklingError(f"it asks for {module}.{name}, which DCP never writes")
        return found

    def _admitted(self, module: str, name: str) -> bool:
        if module in self.MODULES:
            return isinstance(getattr(sys.modules.get(module), name, None), type)
        if module == "torch":
            return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
        return (module, name) in {
            ("torch.serialization", "_get_layout"),
            ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"),
            ("pathlib", "WindowsPath"),
            ("pathlib", "PureWindowsPath"),
            ("collections", "OrderedDict"),
        }


def check_files(folder: Path, verify: bool = True) -> None:
    """Raises ValueError when a file the folder's metadata names is missing, shorter than
    its entries reach (truncated, emptied by a full disk), outside the folder or (where
    ``verify``: it reads every byte) changed since it was written: such a folder is no
    checkpoint, and a resume goes on from the one before it."""
    reach = _data_files(folder)
    for name, needed in sorted(reach.items()):
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            raise ValueError(f"{name} is missing") from None
        if size < needed:
            raise ValueError(f"{name} holds {size} bytes, its metadata reaches byte {needed}")
    if verify:
        check_checksums(folder, reach)


def check_share(folder: Path, rank: int, world_size: int) -> None:
    """Raises ValueError when a file of ``rank``'s share of the folder (every
    ``world_size``-th of its data files) changed since it was written: the ranks read and
    hash a checkpoint together, each about 1/W of it."""
    check_checksums(folder, _data_files(folder), (rank, world_size))


def _data_files(folder: Path) -> dict[str, int]:
    """The data files the folder's metadata names, each with the byte its entries reach."""
    reach: dict[str, int] = {}
    for entry in read_metadata(folder).storage_data.values():
        name = getattr(entry, "relative_path", None)
        if not isinstance(name, str):
            continue
        if Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"its metadata names {name!r}, a file outside the folder")
        reach[name] = max(reach.get(name, 0), int(entry.offset) + int(entry.length))
    return reach
