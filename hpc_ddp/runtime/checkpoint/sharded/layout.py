"""What a checkpoint folder holds: the file that marks it whole, the keys of its blobs, the
run state's format, and how a small value becomes a blob and back."""

from __future__ import annotations

import io
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: The file DCP writes last: a folder holding it is a whole checkpoint.
METADATA = ".metadata"
RUN_KEY = "run"
RANKS_KEY = "rank"
OBJECTS_KEY = "objects"
#: The version of the run state a folder's ``run`` blob holds.
FOLDER_FORMAT = 3


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


def quiet_alone() -> None:
    """DCP working alone (one process) says so at every save and load, from the
    writer's thread too, so a filter around the call is not enough."""
    warnings.filterwarnings(
        "ignore", message=r".*assuming the intent is to (save|load) in a single process"
    )


@dataclass(frozen=True)
class FolderObjects:
    """The registered objects a folder checkpoint holds: how each was saved
    (``module``/``optimizer``: tensors through DCP; ``plain``: a state dict in the run
    blob) and the plain ones' states."""

    folder: Path
    kinds: dict[str, str]
    plain: dict[str, Any]
