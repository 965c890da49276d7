"""Checkpoints as ``step-N/`` folders that every rank writes through
``torch.distributed.checkpoint`` (DCP).

Each rank hands DCP the same state dict shape; DCP writes a replicated tensor once, the
writes spread over the ranks (each writes about 1/W of the bytes), and a sharded one
(FSDP2's DTensors) by each owner. The coordinator writes ``.metadata`` last, through a
temporary name: a folder without it is a save that did not finish, never a checkpoint.

torch.distributed.checkpoint is imported at the first save or load, not with hpc_ddp (it
takes most of a second).

Small values travel as one blob each (``torch.save`` bytes, unpacked with
``weights_only=True``): the run's own state under ``run`` (rank 0's), and each rank's random
streams and batch state under ``rank.<r>``, so a rank reads only its own. torch itself reads
a folder's ``.metadata`` and the wrapper of each non-tensor item with plain pickle; hpc_ddp
reads the metadata admitting only DCP's own classes and each item with ``weights_only=True``,
so a planted pickle runs no code.
"""

from __future__ import annotations

import functools
import io
import pickle
import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hpc_ddp.runtime.checkpoint.checksums import check_checksums, checksumming_writer
from hpc_ddp.runtime.place.dist import several_ranks

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

#: The file DCP writes last: a folder holding it is a whole checkpoint.
METADATA = ".metadata"
RUN_KEY = "run"
RANKS_KEY = "rank"
OBJECTS_KEY = "objects"


def is_complete(folder: Path) -> bool:
    return (folder / METADATA).is_file()


def pack(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def unpack(data: bytes) -> Any:
    if not isinstance(data, bytes):
        raise ValueError(f"a blob of the checkpoint is a {type(data).__name__}, not bytes")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def folder_state(
    tensors: Mapping[str, Any], run: Mapping[str, Any] | None, rank: int, own: Any
) -> dict[str, Any]:
    """What this rank hands DCP: the registered objects' tensors, rank 0's run state (None
    elsewhere) and this rank's own state."""
    state: dict[str, Any] = {OBJECTS_KEY: dict(tensors), RANKS_KEY: {str(rank): pack(own)}}
    if run is not None:
        state[RUN_KEY] = pack(dict(run))
    return state


def _quiet_alone() -> None:
    """DCP working alone (see :func:`_alone`) says so at every save and load, from the
    writer's thread too, so a filter around the call is not enough."""
    warnings.filterwarnings(
        "ignore", message=r".*assuming the intent is to (save|load) in a single process"
    )


def _alone() -> bool:
    """One process, with or without a process group: DCP then works alone (a GPU's group of
    one is NCCL's, on which a background save refuses to run)."""
    _quiet_alone()
    return not several_ranks()


def write_folder(state: dict[str, Any], folder: Path, group: Any | None) -> None:
    """Every rank writes its part of ``folder``; returns once ``.metadata`` is in place (a
    collective on ``group``)."""
    from torch.distributed.checkpoint.state_dict_saver import save

    save(state, storage_writer=checksumming_writer(folder), process_group=group, no_dist=_alone())


def new_stager() -> Any:
    """What copies a state for a background save: into CPU buffers (pinned on a GPU). Where
    :func:`stagers_are_reusable`, kept from one save to the next, so that after the first
    save a copy allocates nothing. Before it returns the copy is complete: training may
    change the tensors at once."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    options = StagingOptions(
        use_pinned_memory=torch.cuda.is_available(),
        use_shared_memory=False,
        use_async_staging=False,
        use_non_blocking_copy=False,
    )
    return DefaultStager(options)


@functools.lru_cache(maxsize=1)
def stagers_are_reusable() -> bool:
    """Whether this torch's stager copies again after its first copy. torch 2.11's empties
    itself after each copy, and its next copy fails (``KeyError: <class 'type'>``): there
    each save needs a stager of its own, which allocates its buffers again. Found by trying
    two copies of one small tensor, not by the version."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    probe = DefaultStager(StagingOptions(False, False, False, False))
    try:
        for _ in range(2):
            probe.stage({"probe": torch.zeros(1)})
    except KeyError:
        return False
    finally:
        probe.close()
    return True


def start_writing(
    state: dict[str, Any], folder: Path, group: Any | None, stager: Any = None
) -> Future[Any]:
    """Copy ``state`` now (through ``stager``, see :func:`new_stager`; None: a new one),
    write it in the background on ``group`` (which nothing else may use meanwhile); the
    future completes once ``.metadata`` is in place."""
    from torch.distributed.checkpoint.state_dict_saver import async_save

    started = async_save(
        state,
        storage_writer=checksumming_writer(folder),
        process_group=group,
        no_dist=_alone(),
        async_stager=stager,
    )
    if not isinstance(started, Future):
        raise TypeError(f"torch's async_save returned {type(started).__name__}")
    return started


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
    _quiet_alone()
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


#: The version of the run state a folder's ``run`` blob holds.
FOLDER_FORMAT = 3


@dataclass(frozen=True)
class FolderObjects:
    """The registered objects a folder checkpoint holds: how each was saved
    (``module``/``optimizer``: tensors through DCP; ``plain``: a state dict in the run
    blob) and the plain ones' states."""

    folder: Path
    kinds: dict[str, str]
    plain: dict[str, Any]


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


def load_run(folder: Path, rank: int, verify: bool = True) -> dict[str, Any]:
    """A folder checkpoint as a single-file one reads (see :mod:`.files`): the run's state,
    this rank's random streams and batch state, and the objects to load on resume;
    ``verify``: its files' checksums too (the rank that chooses the checkpoint does)."""
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
