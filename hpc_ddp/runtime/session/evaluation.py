"""The evaluation split: every sample of a dataset exactly once over all ranks, in batches
whose sums and counts reduce to exact results; with a sharded model, as many batches on every
rank."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.loop.data import DeviceBatches, loader_options, mixed_seed
from hpc_ddp.runtime.loop.streams import no_samples
from hpc_ddp.runtime.monitor.attempt_times import AttemptTimes


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


class _SameCountBatches(DeviceBatches):
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
                last = self.placed(self.loader.collate_fn([self.loader.dataset[0]]))
            empty = no_samples(last)
            for _ in range(self.batches - count):
                yield empty


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
) -> DeviceBatches:
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

    def loader(**batching: Any) -> DataLoader[Any]:
        return DataLoader(
            dataset, num_workers=num_workers, collate_fn=collate_fn, **batching, **options
        )

    if not same_count:
        return DeviceBatches(loader(batch_size=batch_size, sampler=sampler), device)
    largest_share = -(-len(dataset) // world_size)  # type: ignore[arg-type]
    count = -(-largest_share // batch_size)
    batches = even_batches(list(sampler), count)
    return _SameCountBatches(
        loader(batch_sampler=[batch for batch in batches if batch]), device, count
    )


class EvalBatches:
    """What :meth:`hpc_ddp.Run.eval_loader` returns: :func:`eval_loader`'s batches, laid out
    for a sharded model (as many batches on every rank) once ``holds_shards()`` says the run
    has one. That is asked again at the first iteration: a script may shard its model with
    its own ``fully_shard`` and register it after making its loaders."""

    def __init__(
        self,
        build: Callable[[bool], DeviceBatches],
        holds_shards: Callable[[], bool],
        times: AttemptTimes,
    ) -> None:
        self._build, self._holds_shards, self._times = build, holds_shards, times
        self._settled = holds_shards()  # sharded already: nothing left to choose
        self._batches = build(self._settled)  # bad options are refused here, at once

    @property
    def loader(self) -> DataLoader[Any]:
        """The DataLoader underneath."""
        return self._chosen().loader

    def _chosen(self) -> DeviceBatches:
        if not self._settled:
            self._settled = True
            if self._holds_shards():
                self._batches = self._build(True)
        return self._batches

    def __len__(self) -> int:
        return len(self._chosen())

    def __iter__(self) -> Iterator[Any]:
        with self._times.counting("evaluation"):  # the evaluation's steps as well
            yield from self._chosen()
