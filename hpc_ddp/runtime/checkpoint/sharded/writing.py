"""Writing a checkpoint folder: every rank its part, at once or in the background."""

from __future__ import annotations

import functools
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from hpc_ddp.runtime.checkpoint.checksums import checksumming_writer
from hpc_ddp.runtime.checkpoint.sharded.layout import quiet_alone
from hpc_ddp.runtime.place.dist import several_ranks


def _alone() -> bool:
    """One process, with or without a process group: DCP then works alone (a GPU's group of
    one is NCCL's, on which a background save refuses to run)."""
    quiet_alone()
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
