"""Per-rank loaders over a user's Dataset: sharded, resumable training micro-batches, with
batches of any structure moved to the rank's device (the evaluation split is in
:mod:`hpc_ddp.runtime.session.evaluation`), and what run.steps iterates: a loader positioned
by step as it is, any other iterable as a stream (:mod:`hpc_ddp.runtime.loop.streams`)."""

from __future__ import annotations

import hashlib
import itertools
import operator
import random
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.loop.streams import BatchStream, move_to
from hpc_ddp.runtime.place.plan import micro_batch_size

#: Said once when a run.train_loader is iterated without run.steps.
ITERATED_DIRECTLY = (
    "run.train_loader(...) is iterated directly: no stops, checkpoints, resume or metrics "
    "between its steps, and the run counts none of them. HINT: for batch in run.steps(loader):"
)


class StepLoader(Protocol):
    """A loader that positions itself by optimizer step, as :meth:`hpc_ddp.Run.train_loader`'s
    does: :meth:`hpc_ddp.Run.steps` takes one of your own too (a sharded store that can seek),
    and a run resumed mid-epoch calls :meth:`set_position` instead of replaying batches.

    Every rank must yield the same number of micro-batches per epoch, ``grad_accum_steps``
    per optimizer step."""

    #: Optimizer steps in a whole epoch (the same on every rank).
    steps_per_epoch: int
    #: Micro-batches per optimizer step.
    grad_accum_steps: int
    #: Samples per optimizer step over all ranks and micro-batches.
    global_batch_size: int

    def set_position(self, epoch: int, step: int) -> None:
        """Make the next iteration yield ``epoch``'s micro-batches from optimizer step
        ``step`` on, without loading the ones before."""

    def __iter__(self) -> Iterator[Any]: ...


def mixed_seed(*parts: int) -> int:
    """A 63-bit seed from several integers, the same in every process."""
    text = "/".join(str(part) for part in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1


def seed_rank_streams(seed: int, rank: int, step: int) -> None:
    """Each rank's own random streams (dropout, augmentation in the main process), from the
    run's seed, the rank and the step: for a fresh run, and for one resumed on another
    number of ranks, whose saved per-rank streams do not fit."""
    rank_seed = mixed_seed(seed, rank, step)
    torch.manual_seed(rank_seed)
    random.seed(rank_seed)


class ResumableDistributedSampler(DistributedSampler[Any]):
    """DistributedSampler that can start an epoch part-way, without touching the skipped
    samples: the order is DistributedSampler's (seed + epoch), minus the first ``skip``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skip = 0

    def set_start(self, skip: int) -> None:
        """Skip this rank's first ``skip`` samples of the current epoch (0: whole epoch)."""
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        if not self.skip:
            return super().__iter__()
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return max(0, super().__len__() - self.skip)


#: DataLoader options the run's loaders set themselves, and what to do instead.
SHARDING_OPTIONS = {
    "sampler": "pass your own DataLoader (with its per-rank sampler) to run.steps() instead",
    "batch_sampler": "pass your own DataLoader to run.steps() instead",
    "batch_size": "give the batch as the second argument (the GLOBAL batch)",
    "drop_last": "the training loader keeps full global batches only; evaluation never "
    "drops a sample (every sample once)",
}


def loader_options(
    num_workers: int, device: torch.device | None, given: Mapping[str, Any], what: str
) -> dict[str, Any]:
    """The DataLoader options for one of the run's loaders: its defaults (pinned memory on a
    GPU, persistent prefetching workers) with the user's ``given`` ones over them; an option
    that would undo the sharding is refused, naming what to do instead."""
    for name in given:
        if name in SHARDING_OPTIONS:
            raise HpcDdpError(
                f"{what}(..., {name}=...): the run's loader shards the data itself",
                SHARDING_OPTIONS[name],
            )
    options: dict[str, Any] = {"pin_memory": device is not None and device.type == "cuda"}
    if num_workers:
        options.update(persistent_workers=True, prefetch_factor=4)
    options.update(given)
    return options


class DeviceBatches:
    """Iterates a DataLoader, moving each batch to ``device`` (not at all on the CPU, where
    the loader's tensors already are)."""

    def __init__(self, loader: DataLoader[Any], device: torch.device | None) -> None:
        self.loader = loader
        self.device = device if device is not None and device.type != "cpu" else None

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if self.device is None:
            return iter(self.loader)
        return (self.placed(batch) for batch in self.loader)

    def placed(self, batch: Any) -> Any:
        """``batch`` on this rank's device."""
        return batch if self.device is None else move_to(batch, self.device)


class TrainLoader(DeviceBatches):
    """This rank's shuffled share of ``dataset`` in micro-batches, for :meth:`Run.steps`.

    Only full global batches: every optimizer step holds exactly ``global_batch_size``
    samples at any world size. The order is DistributedSampler's (``seed`` + epoch); starting
    mid-epoch skips the consumed samples' indices without loading them. The loader draws
    nothing from the global random streams, so a resumed run's streams match an
    uninterrupted one's.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        rank: int,
        world_size: int,
        global_batch_size: int,
        grad_accum_steps: int,
        seed: int,
        num_workers: int,
        device: torch.device | None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        shuffle: bool = True,
        **dataloader_kwargs: Any,
    ) -> None:
        self.global_batch_size = global_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.micro_batch_size = micro_batch_size(global_batch_size, world_size, grad_accum_steps)
        self.rank = rank
        self.seed = seed
        self.sampler = ResumableDistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=True
        )
        options = loader_options(num_workers, device, dataloader_kwargs, "run.train_loader")
        # Reseeded from the position at every epoch (set_position), a user's own one too.
        self._generator = options.pop("generator", None) or torch.Generator()
        loader: DataLoader[Any] = DataLoader(
            dataset,
            batch_size=self.micro_batch_size,
            sampler=self.sampler,
            drop_last=True,
            num_workers=num_workers,
            collate_fn=collate_fn,
            generator=self._generator,
            **options,
        )
        super().__init__(loader, device)
        self.steps_per_epoch = len(loader) // grad_accum_steps
        self._positioned = False
        self._warned = False

    @property
    def dataset(self) -> Dataset[Any]:
        """The whole dataset, as a DataLoader's ``dataset`` (this rank reads its share)."""
        return self.loader.dataset

    @property
    def batch_size(self) -> int:
        """Samples per micro-batch on this rank, as a DataLoader's ``batch_size``."""
        return self.micro_batch_size

    def __iter__(self) -> Iterator[Any]:
        if not self._positioned and not self._warned and self.rank == 0:
            self._warned = True
            get_logger().warning(ITERATED_DIRECTLY)
        self._positioned = False
        return super().__iter__()

    def set_position(self, epoch: int, step: int) -> None:
        self._positioned = True
        self.sampler.set_epoch(epoch)
        self.sampler.set_start(step * self.grad_accum_steps * self.micro_batch_size)
        # Worker seeds come from this generator: fixed by the position, never by the global
        # random streams, which a fresh iterator would otherwise draw from.
        self._generator.manual_seed(mixed_seed(self.seed, epoch, step, self.rank))


def _whole(value: object) -> bool:
    """An integer of any kind (numpy's too), not a bool."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


#: What a loader positioned by step holds beside ``set_position`` (see StepLoader).
STEP_LOADER_FIELDS = ("steps_per_epoch", "grad_accum_steps", "global_batch_size")


def step_source(loader: Any, grad_accum_steps: int | None) -> Any:
    """What :meth:`hpc_ddp.Run.steps` iterates: a loader positioned by step (``set_position``
    and the sizes, as run.train_loader's) as it is, any other iterable as a
    :class:`BatchStream`. An iterable with a ``set_position`` of its own and none of the
    sizes is any other; one with some of them is refused, naming those it lacks."""
    holds = [name for name in STEP_LOADER_FIELDS if _whole(getattr(loader, name, None))]
    if not callable(getattr(loader, "set_position", None)) or not holds:
        return BatchStream(loader, 1 if grad_accum_steps is None else grad_accum_steps)
    if len(holds) < len(STEP_LOADER_FIELDS):
        lacks = [name for name in STEP_LOADER_FIELDS if name not in holds]
        raise HpcDdpError(
            f"run.steps got a {type(loader).__name__} with set_position() and "
            f"{', '.join(holds)}, but no whole {', '.join(lacks)}: it is neither a loader "
            "positioned by step nor a plain iterable",
            f"give it {', '.join(lacks)} (see hpc_ddp.StepLoader), or take "
            f"{', '.join(holds)} off it to have it iterated as any other",
        )
    if grad_accum_steps is not None:
        raise HpcDdpError(
            "run.steps(loader, grad_accum_steps=...) with a run.train_loader()",
            "give grad_accum_steps to run.train_loader(); it shapes the loader's micro-batches",
        )
    return loader
