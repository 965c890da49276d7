"""Per-rank loaders over a user's Dataset: sharded, resumable training micro-batches and an
exact evaluation split, with batches of any structure moved to the rank's device."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.loop.streams import move_to, no_samples
from hpc_ddp.runtime.place.plan import micro_batch_size


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


class ShardedEvalSampler(Sampler[int]):
    """Rank r takes indices r, r+W, r+2W, ...: every sample exactly once over all ranks.

    Unlike DistributedSampler it neither pads with duplicates nor drops a tail, so shards
    may differ in length by one; evaluation sums and counts, so that is exact.
    """

    def __init__(self, dataset_size: int, rank: int, world_size: int) -> None:
        self.dataset_size = dataset_size
        self.rank = rank
        self.world_size = world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.dataset_size, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.dataset_size, self.world_size))


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


class _DeviceBatches:
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
        device = self.device
        return (move_to(batch, device) for batch in self.loader)


def even_batches(indices: list[int], count: int) -> list[list[int]]:
    """``indices`` in ``count`` consecutive batches whose sizes differ by one at most (empty
    ones only where there are fewer indices than batches)."""
    size, extra = divmod(len(indices), count)
    batches, start = [], 0
    for number in range(count):
        end = start + size + (1 if number < extra else 0)
        batches.append(indices[start:end])
        start = end
    return batches


class _SameCountBatches(_DeviceBatches):
    """As many batches on every rank, so that every rank runs as many forward passes (a
    sharded model gathers its parameters in each: a rank that stopped early would leave the
    others waiting). Each rank's share is split into that many batches of nearly equal
    size; only a share smaller than the count (one sample a batch, or a dataset smaller
    than the world) ends with empty batches (each tensor cut to 0 samples)."""

    def __init__(self, loader: DataLoader[Any], device: torch.device | None, batches: int) -> None:
        super().__init__(loader, device)
        self.batches = batches

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Iterator[Any]:
        last, count = None, 0
        for last in super().__iter__():
            count += 1
            yield last
        if count < self.batches:
            if last is None:  # this rank's share is empty: a batch of one sample, cut to none
                dataset, collate = self.loader.dataset, self.loader.collate_fn
                last = (
                    move_to(collate([dataset[0]]), self.device)
                    if self.device
                    else collate([dataset[0]])
                )
            empty = no_samples(last)
            for _ in range(self.batches - count):
                yield empty


class TrainLoader(_DeviceBatches):
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

    def __iter__(self) -> Iterator[Any]:
        if not self._positioned and not self._warned and self.rank == 0:
            self._warned = True
            get_logger().warning(
                "run.train_loader(...) is iterated directly: no stops, checkpoints, resume "
                "or metrics between its steps, and the run counts none of them. HINT: "
                "for batch in run.steps(loader):"
            )
        self._positioned = False
        return super().__iter__()

    def set_position(self, epoch: int, step: int) -> None:
        self._positioned = True
        self.sampler.set_epoch(epoch)
        self.sampler.set_start(step * self.grad_accum_steps * self.micro_batch_size)
        # Worker seeds come from this generator: fixed by the position, never by the global
        # random streams, which a fresh iterator would otherwise draw from.
        self._generator.manual_seed(mixed_seed(self.seed, epoch, step, self.rank))


def eval_loader(
    dataset: Dataset[Any],
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    num_workers: int,
    device: torch.device | None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    same_count: bool = False,
    **dataloader_kwargs: Any,
) -> _DeviceBatches:
    """Every sample of ``dataset`` exactly once across ranks, ``batch_size`` per rank (see
    ShardedEvalSampler): sum and count per batch, and the reduced result is exact.
    ``same_count``: as many batches on every rank (see :class:`_SameCountBatches`)."""
    if dataloader_kwargs.get("shuffle"):
        raise HpcDdpError(
            "run.eval_loader(..., shuffle=True): evaluation visits every sample once, in order",
            "leave shuffle out; the sums are the same in any order",
        )
    dataloader_kwargs = {k: v for k, v in dataloader_kwargs.items() if k != "shuffle"}
    options = loader_options(num_workers, device, dataloader_kwargs, "run.eval_loader")
    options.setdefault("generator", torch.Generator().manual_seed(mixed_seed(rank)))
    sampler = ShardedEvalSampler(len(dataset), rank, world_size)  # type: ignore[arg-type]
    if same_count:
        largest_share = -(-len(dataset) // world_size)  # type: ignore[arg-type]
        count = -(-largest_share // batch_size)
        batches = even_batches(list(sampler), count)
        loader: DataLoader[Any] = DataLoader(
            dataset,
            batch_sampler=[batch for batch in batches if batch],
            num_workers=num_workers,
            collate_fn=collate_fn,
            **options,
        )
        return _SameCountBatches(loader, device, count)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_fn,
        **options,
    )
    return _DeviceBatches(loader, device)
