"""Reading a checkpoint folder: each process alone (no collective, so no peer can hang it),
each non-tensor item with ``weights_only=True``."""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hpc_ddp.runtime.checkpoint.sharded.layout import (
    FOLDER_FORMAT,
    METADATA,
    OBJECTS_KEY,
    RANKS_KEY,
    RUN_KEY,
    FolderObjects,
    is_complete,
    pack,
    quiet_alone,
    unpack,
)
from hpc_ddp.runtime.checkpoint.sharded.metadata import check_files, read_metadata

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


def _reader(folder: Path) -> Any:
    """DCP's reader of ``folder``, handed the metadata :func:`read_metadata` keeps."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    class KeptMetadataReader(FileSystemReader):
        def read_metadata(self, *_args: Any, **_kwargs: Any) -> Metadata:
            return read_metadata(folder)

    return KeptMetadataReader(folder)


def _load(template: dict[str, Any], folder: Path) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    class SafeBytesPlanner(DefaultLoadPlanner):
        """DCP's planner, reading each non-tensor item with ``weights_only=True`` (torch's
        own reads it with plain pickle, which would run a planted blob's code)."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded = torch.load(value, map_location="cpu", weights_only=True)
            super().load_bytes(read_item, io.BytesIO(pack(loaded)))

    # Each process reads what it needs alone: no collective, so no peer can hang it.
    quiet_alone()
    dcp_load(template, storage_reader=_reader(folder), planner=SafeBytesPlanner(), no_dist=True)


def read_blobs(folder: Path, keys: Iterable[str]) -> dict[str, Any]:
    """The blobs named by dotted ``keys`` (``run``, ``rank.3``), unpacked."""
    template: dict[str, Any] = {}
    for key in keys:
        head, _, tail = key.partition(".")
        if tail:
            template.setdefault(head, {})[tail] = b""
        else:
            template[head] = b""
    _load(template, folder)
    found: dict[str, Any] = {}
    for key in keys:
        head, _, tail = key.partition(".")
        found[key] = unpack(template[head][tail] if tail else template[head])
    return found


def load_objects(folder: Path, templates: dict[str, Any]) -> None:
    """Read the registered objects' tensors into ``templates`` (name -> state dict), in
    place; each rank reads only what its tensors (or shards) cover."""
    _load({OBJECTS_KEY: templates}, folder)


def full_tensors(folder: Path, name: str, with_values: bool = False) -> dict[str, Any]:
    """Registered object ``name``'s tensors, whole, without a process group or the model's
    class: the shapes come from the metadata. ``with_values``: its other values too (an
    optimizer's settings: ``param_groups.0.lr``)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    prefix = f"{OBJECTS_KEY}.{name}."
    template: dict[str, Any] = {}
    for key, entry in read_metadata(folder).state_dict_metadata.items():
        if not key.startswith(prefix):
            continue
        if isinstance(entry, TensorStorageMetadata):
            template[key[len(prefix) :]] = torch.empty(entry.size, dtype=entry.properties.dtype)
        elif with_values and isinstance(entry, BytesStorageMetadata):
            template[key[len(prefix) :]] = b""  # a placeholder: DCP puts the value there
    if template:
        _load({OBJECTS_KEY: {name: template}}, folder)
    return template


class OwnRankOnly(Sequence[Any]):
    """Every rank's saved state as the single-file checkpoints list it, of which this rank
    read only its own (reading W ranks' would cost every rank W times the bytes)."""

    def __init__(self, world_size: int, rank: int, own: Any) -> None:
        self.world_size = world_size
        self.rank = rank
        self.own = own

    def __len__(self) -> int:
        return self.world_size

    def __getitem__(self, index: Any) -> Any:
        if index != self.rank:
            raise LookupError(f"rank {self.rank} read its own saved state, not rank {index}'s")
        return self.own

    def __iter__(self) -> Iterator[Any]:
        raise LookupError("each rank reads its own saved state only")


def load_run(folder: Path, rank: int, verify: bool = True) -> dict[str, Any]:
    """A folder checkpoint as a single-file one reads (see
    :mod:`hpc_ddp.runtime.checkpoint.files`): the run's state, this rank's random streams and
    batch state, and the objects to load on resume; ``verify``: its files' checksums too (the
    rank that chooses the checkpoint does)."""
    if not is_complete(folder):
        raise ValueError(f"no {METADATA}: a save that did not finish")
    check_files(folder, verify)
    run = read_blobs(folder, [RUN_KEY])[RUN_KEY]
    if not isinstance(run, dict) or run.get("format") != FOLDER_FORMAT:
        found = run.get("format") if isinstance(run, dict) else type(run).__name__
        raise ValueError(f"format {found!r}: this hpc_ddp reads format {FOLDER_FORMAT}")
    world_size = int(run["world_size"])
    own: dict[str, Any] = {"rng": None, "streams": None}
    if rank < world_size:
        own = read_blobs(folder, [f"{RANKS_KEY}.{rank}"])[f"{RANKS_KEY}.{rank}"]
    return {
        **run,
        "objects": FolderObjects(folder, dict(run["kinds"]), dict(run["plain"])),
        "rng": OwnRankOnly(world_size, rank, own["rng"]),
        "streams": OwnRankOnly(world_size, rank, own["streams"]) if run["has_streams"] else None,
        "per_rank": OwnRankOnly(world_size, rank, own.get("per_rank")),
        "buffers": OwnRankOnly(world_size, rank, own.get("buffers")),
    }
