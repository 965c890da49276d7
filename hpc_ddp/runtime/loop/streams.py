"""Any iterable of batches as the steps of a run: a user's own DataLoader (with their own
sampler), a StatefulDataLoader, an endless generator like nanoGPT's ``get_batch``.

:meth:`hpc_ddp.Run.steps` takes :class:`hpc_ddp.runtime.loop.data.TrainLoader` (positioned by
index, nothing replayed) or any iterable. For the latter, what an exact resume needs is
restored by the kind of iterable, and said once when it matters:

- it has ``state_dict()``/``load_state_dict()`` (torchdata's StatefulDataLoader, your own):
  each rank's state is saved in every checkpoint and loaded back; nothing is replayed;
- it can be iterated again and has a length (a plain DataLoader): an epoch is one pass,
  and a run resumed mid-epoch REPLAYS the micro-batches already trained on (loads and
  discards them, with the random streams held), so the order must come from the sampler's
  own seed and epoch (DistributedSampler + set_epoch, or a ``generator=``);
- it is an iterator (a generator): one endless epoch; a resume draws on from the restored
  random streams (torch, Python), which is exact when its batches come from them.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from hpc_ddp.runtime.checkpoint.state import check_loadable
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.logs import get_logger


def is_stateful(value: object) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def batch_length(batch: Any) -> int | None:
    """Samples in a micro-batch: the leading size of its first tensor (or its length, for a
    list of samples); None when it holds no tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, Mapping):
        values: Iterable[Any] = batch.values()
    elif isinstance(batch, list | tuple):
        values = batch
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        values = (getattr(batch, field.name) for field in dataclasses.fields(batch))
    else:
        return None
    for value in values:
        found = batch_length(value)
        if found is not None:
            return found
    return None


def map_tensors(batch: Any, change: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` with ``change`` applied to every tensor in it: tensors, dicts (and other
    mappings), lists, tuples (named ones too) and dataclasses, nested; anything else as it
    is, each container of the type it was."""
    if isinstance(batch, torch.Tensor):
        return change(batch)
    if isinstance(batch, Mapping):
        changed = {key: map_tensors(value, change) for key, value in batch.items()}
        if type(batch) is dict:
            return changed
        try:
            return type(batch)(changed)  # type: ignore[call-arg]
        except TypeError:  # a mapping not built from a dict (defaultdict): a plain one
            return changed
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(map_tensors(value, change) for value in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(map_tensors(value, change) for value in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = dataclasses.fields(batch)
        changes = {f.name: map_tensors(getattr(batch, f.name), change) for f in fields if f.init}
        return dataclasses.replace(batch, **changes)
    return batch


def move_to(batch: Any, device: torch.device) -> Any:
    """``batch`` (of any structure :func:`map_tensors` walks) with every tensor on ``device``."""
    return map_tensors(batch, lambda tensor: tensor.to(device, non_blocking=True))


def no_samples(batch: Any) -> Any:
    """``batch`` (of any structure :func:`map_tensors` walks) with every tensor cut to 0
    samples."""
    return map_tensors(batch, lambda tensor: tensor[:0] if tensor.dim() else tensor)


class BatchStream:
    """A user's iterable of micro-batches, counted in optimizer steps of
    ``grad_accum_steps`` micro-batches (see the module docstring)."""

    def __init__(self, batches: Iterable[Any], grad_accum_steps: int) -> None:
        if isinstance(batches, str | bytes) or not isinstance(batches, Iterable):
            raise HpcDdpError(
                f"run.steps() got {type(batches).__name__}, which is not an iterable of batches",
                "pass run.train_loader(...), your own DataLoader, or any iterable or generator "
                "that yields batches; run.iterations() counts steps without batches",
            )
        if isinstance(grad_accum_steps, bool) or not isinstance(grad_accum_steps, int):
            raise HpcDdpError(
                f"grad_accum_steps={grad_accum_steps!r} is not an integer",
                "micro-batches per optimizer step, e.g. grad_accum_steps=4",
            )
        if grad_accum_steps < 1:
            raise HpcDdpError(
                f"grad_accum_steps={grad_accum_steps} is below 1", "e.g. grad_accum_steps=1"
            )
        self.batches = batches
        self.grad_accum_steps = grad_accum_steps
        self.stateful = is_stateful(batches)
        # iter() only on what has __next__: a DataLoader's iter() draws a seed from torch's
        # random stream (a resume would then differ) and starts its workers.
        self.endless = (
            isinstance(batches, Iterator) and iter(batches) is batches
            if not self.stateful
            else not _sized(batches)
        )
        self.steps_per_epoch: int | None = (
            None if self.endless else len(batches) // grad_accum_steps  # type: ignore[arg-type]
        )
        #: Samples per optimizer step over all ranks: set from the first micro-batch.
        self.global_batch_size = 0
        self._replay = 0

    @property
    def kind(self) -> str:
        """How this stream resumes, in words (for the one line said at a resume)."""
        name = type(self.batches).__name__
        if isinstance(self.batches, Ticks):
            return (
                "run.iterations() draws nothing itself; the random streams your batches come "
                "from (torch, Python) are restored, so draws from them go on exactly"
            )
        if self.stateful:
            return f"{name}: its state_dict() is saved per rank and loaded back"
        if self.endless:
            return (
                f"{name} is an iterator without state_dict(): it draws on from the restored "
                "random streams (exact when its batches come from torch's or Python's random "
                "streams); give it state_dict()/load_state_dict() to save its own position"
            )
        if isinstance(self.batches, range | list | tuple):
            return (
                f"{name}: the micro-batches of the epoch already trained on are passed over "
                "(exact when each epoch builds it as before: a shuffle from a generator seeded "
                "with the epoch, not from the random streams, which the resume restores as "
                "they were at the stop, not at the epoch's start)"
            )
        return (
            f"{name} without state_dict(): the micro-batches of the epoch already trained on "
            "are replayed (loaded and discarded); exact when its order comes from its "
            "sampler's seed and epoch (DistributedSampler with set_epoch, or generator=). "
            "HINT: run.train_loader() skips them without loading"
        )

    def set_position(self, epoch: int, step: int) -> None:
        """Start the next pass ``step`` optimizer steps into the epoch (replayed for a
        re-iterable without state; a stateful or endless stream is already there)."""
        del epoch  # the user's sampler knows its epoch (set_epoch)
        replayable = not (self.stateful or self.endless)
        self._replay = step * self.grad_accum_steps if replayable else 0

    def __iter__(self) -> Iterator[Any]:
        if not self._replay:
            return iter(self.batches)
        skip, self._replay = self._replay, 0
        # The random streams as the checkpoint left them: drawing worker seeds and skipped
        # batches must not move them, or the steps after the resume would differ.
        held = torch.get_rng_state(), random.getstate()
        batches = iter(self.batches)
        for _ in range(skip):
            if next(batches, _END) is _END:
                break
        torch.set_rng_state(held[0])
        random.setstate(held[1])
        return batches

    def state_dict(self) -> Any:
        return self.batches.state_dict() if self.stateful else None  # type: ignore[attr-defined]

    def load_state_dict(self, state: Any) -> None:
        if self.stateful and state is not None:
            self.batches.load_state_dict(state)  # type: ignore[attr-defined]


_END = object()


def _sized(value: object) -> bool:
    try:
        len(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def unsharded_sampler(batches: object, world_size: int) -> str | None:
    """Why each of ``world_size`` ranks would read the whole dataset: ``batches`` is a
    DataLoader over a map-style dataset that samples with torch's RandomSampler or
    SequentialSampler, which do not split it by rank; None otherwise (a sampler of the
    user's own, DistributedSampler, an IterableDataset, one rank)."""
    if world_size < 2 or not isinstance(batches, DataLoader):
        return None
    if isinstance(batches.dataset, IterableDataset):
        return None
    batch_sampler = batches.batch_sampler  # None for batch_size=None: samples one by one
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        return None  # a batch sampler of the user's own may shard
    sampler = batches.sampler if batch_sampler is None else batch_sampler.sampler
    torchs_own = (RandomSampler, SequentialSampler)  # a subclass may shard: the user's own
    if not isinstance(sampler, torchs_own) or type(sampler) not in torchs_own:
        return None
    return (
        f"run.steps() got a DataLoader whose {type(sampler).__name__} reads all "
        f"{len(sampler)} samples of its dataset on each of the {world_size} ranks: every "
        "rank trains on the whole dataset each epoch, not on a share of its own. HINT: "
        "run.train_loader(dataset, batch_size=GLOBAL_BATCH) shards it (and a resume skips "
        "what was trained on without loading it); or give your DataLoader "
        "sampler=DistributedSampler(dataset, seed=...) and call sampler.set_epoch(epoch) each "
        "epoch. A dataset that holds only this rank's own shard is right as it is"
    )


class StreamStates:
    """The user's iterable across checkpoints: each rank's state saved and given back to the
    next stream the loop takes, and how it resumes said once."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.current: BatchStream | None = None
        self._saved: list[Any] | None = None
        self._same_world = True
        self._said = False
        self._sharding_checked = False

    def take(self, stream: BatchStream, resumed_from_step: int | None) -> None:
        """Step through ``stream`` from now on: it gets this rank's saved state, if any."""
        self.current = stream
        if self.rank == 0 and not self._sharding_checked:
            self._sharding_checked = True
            unsharded = unsharded_sampler(stream.batches, self.world_size)
            if unsharded is not None:
                get_logger().warning(unsharded)
        saved, self._saved = self._saved, None
        if saved is not None and stream.stateful:
            if len(saved) == self.world_size:
                stream.load_state_dict(saved[self.rank])
            elif self.rank == 0:
                get_logger().warning(
                    f"the checkpoint holds the batches' state of {len(saved)} ranks, this run "
                    f"has {self.world_size}: each rank's {type(stream.batches).__name__} "
                    "starts from its own beginning, not where the run stopped"
                )
        # At another world size the resume's warning says what goes on and what starts anew.
        if resumed_from_step and self._same_world and not self._said and self.rank == 0:
            self._said = True
            get_logger().info(f"resuming the batches at step {resumed_from_step}: {stream.kind}")

    def own_state(self) -> Any:
        """This rank's state of a stateful stream (None for a stream without state)."""
        stream = self.current
        if stream is None or not stream.stateful:
            return None
        mine = stream.state_dict()
        check_loadable(f"the batches' {type(stream.batches).__name__}", mine)
        return mine

    def restore(self, saved: list[Any] | None, saved_world_size: int) -> None:
        """A checkpoint's per-rank states (written by ``saved_world_size`` ranks), for the
        next stream taken."""
        self._saved = saved
        self._same_world = saved_world_size == self.world_size


class Ticks:
    """An endless iterator of nothing: :meth:`hpc_ddp.Run.iterations` counts optimizer steps
    with it where the user's loop draws its own batches."""

    def __iter__(self) -> Iterator[None]:
        return self

    def __next__(self) -> None:
        return None
