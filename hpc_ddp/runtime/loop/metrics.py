"""Metrics summed across ranks: exact, and off the hot path.

A metric is a total with the count it was summed over (a loss summed over a batch and the
batch's size; correct predictions and samples; a confusion matrix and samples). Totals and
counts are added up per rank in float64 and summed over all ranks in one all-reduce, so the
result is the same whatever the number of ranks and however the samples were split.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.names import check_name
from hpc_ddp.runtime.place.dist import all_gather_object, all_reduce_sum, several_ranks

#: Per-batch totals an entry holds before summing them (bounds memory on long intervals).
PENDING_MAX = 1024

Number = float | int
Value = torch.Tensor | Number


@dataclass(frozen=True)
class Sum:
    """A metric summed over all ranks: ``total`` (a float, or a CPU float64 tensor for a
    tensor metric) over ``count`` items."""

    total: Any
    count: float

    @property
    def mean(self) -> Any:
        """total / count (NaN, or NaNs, when nothing was counted)."""
        if self.count == 0:
            return self.total * math.nan
        return self.total / self.count


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """``metrics`` as floats for a tracker: a :class:`Sum` as its mean, a 0-d tensor or a
    number as it is; anything else refused naming the metric."""
    values = {}
    for name, value in metrics.items():
        check_name(name, "run.log_metrics")
        value = value.mean if isinstance(value, Sum) else value
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise HpcDdpError(
                f"run.log_metrics got {name}={type(value).__name__}, which is not one number",
                "log numbers, 0-d tensors or hpc_ddp.Sum values; a tensor metric's parts "
                "one by one (e.g. {f'acc_{i}': v for i, v in enumerate(sum.mean.tolist())})",
            )
        values[name] = float(value)
    return values


@dataclass
class _Entry:
    """One metric's running total and count on this rank.

    Adding a tensor only keeps a reference (no kernel): the kept tensors are summed in one
    go when the entry is read, or when PENDING_MAX of them have piled up."""

    pending: list[torch.Tensor] = field(default_factory=list)
    host_total: float = 0.0
    pending_counts: list[torch.Tensor] = field(default_factory=list)
    host_count: float = 0.0
    shape: tuple[int, ...] | None = None

    def add(self, total: Value, count: Value) -> None:
        if isinstance(total, torch.Tensor):
            self.pending.append(total.detach())
            if len(self.pending) >= PENDING_MAX:
                self.pending = [self._summed(self.pending, self.pending[0].device)]
        else:
            self.host_total += float(total)
        if isinstance(count, torch.Tensor):
            self.pending_counts.append(count.detach())
            if len(self.pending_counts) >= PENDING_MAX:
                self.pending_counts = [self._summed(self.pending_counts, count.device)]
        else:
            self.host_count += float(count)

    @staticmethod
    def _summed(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The sum of ``tensors`` in float64 on ``device``, in their order. Each run of
        alike tensors (one dtype and device: all but an earlier sum, as a rule) is stacked as
        it is and converted at once: the same values as each converted alone, without a
        conversion call per tensor."""
        runs, start = [], 0
        for index in range(1, len(tensors) + 1):
            if (
                index == len(tensors)
                or tensors[index].dtype != tensors[start].dtype
                or tensors[index].device != tensors[start].device
            ):
                runs.append(torch.stack(tensors[start:index]).to(device, torch.float64))
                start = index
        return torch.cat(runs).sum(dim=0)

    def packed(self, device: torch.device) -> torch.Tensor:
        """[total..., count] as one float64 vector on ``device``."""
        shape = self.shape or ()
        total = torch.full(shape, self.host_total, dtype=torch.float64, device=device)
        if self.pending:
            total = total + self._summed(self.pending, device)
        # A fill, not a copy from the host: on a GPU a copy would wait for the queued work.
        count = torch.full((1,), self.host_count, dtype=torch.float64, device=device)
        if self.pending_counts:
            count = count + self._summed(self.pending_counts, device).reshape(1)
        return torch.cat([total.reshape(-1), count])


def _signature(names: list[tuple[str, tuple[int, ...] | None]]) -> float:
    """A 40-bit number for the metric names and shapes, the same in every process (float64
    holds it exactly, and its negation, for an all-reduce)."""
    digest = hashlib.sha256(repr(names).encode()).digest()
    return float(int.from_bytes(digest[:5], "little"))


def _shape_of(value: Value) -> tuple[int, ...]:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


class Sums:
    """Totals and counts per metric name, summed over all ranks by :meth:`reduce`.

    ``add`` never synchronises the device; ``reduce`` is a collective that every rank must
    call at the same point, having added the same metric names.
    """

    def __init__(self, device: torch.device, group: Any | None = None) -> None:
        self.device = device
        #: The (gloo) group the metric names are compared over.
        self.group = group
        self._entries: dict[str, _Entry] = {}

    def add(self, name: str, total: Value, count: Value = 1) -> None:
        """Add ``total`` (a number or a tensor of any fixed shape, summed over ``count``
        items) to metric ``name``."""
        entry = self._entries.get(name)
        if entry is None:
            entry = self._entries[name] = _Entry(shape=_shape_of(total))
        elif isinstance(total, torch.Tensor) and total.shape != entry.shape:
            raise HpcDdpError(
                f"metric {name!r} was added with shape {entry.shape} and now with "
                f"{tuple(total.shape)}",
                "add the same shape of total for a metric every time",
            )
        entry.add(total, count)

    @property
    def names(self) -> list[str]:
        return sorted(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def local(self) -> torch.Tensor:
        """This rank's totals and counts, in name order, as one float64 vector."""
        if not self._entries:
            return torch.zeros(0, dtype=torch.float64, device=self.device)
        return torch.cat([self._entries[name].packed(self.device) for name in self.names])

    def agree(self) -> None:
        """Check that every rank holds the same metric names and shapes (a collective: one
        tiny all-reduce; the names themselves travel only when they differ)."""
        mine = [(name, self._entries[name].shape) for name in self.names]
        signature = _signature(mine)
        extremes = torch.tensor([signature, -signature], dtype=torch.float64)
        if several_ranks():
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.group)
        if extremes.tolist() == [signature, -signature]:
            return
        for rank, theirs in enumerate(all_gather_object(mine, self.group)):
            if theirs != mine:
                raise HpcDdpError(
                    f"the ranks logged different metrics: this rank has {mine}, rank {rank} "
                    f"has {theirs}",
                    "add the same metric names (with the same shapes) on every rank, e.g. "
                    "outside any `if rank == 0` branch",
                )

    def unpack(self, packed: torch.Tensor | list[float]) -> dict[str, Sum]:
        """Split a vector laid out like :meth:`local` back into named sums."""
        values = (
            packed.double().cpu()
            if isinstance(packed, torch.Tensor)
            else torch.tensor(packed, dtype=torch.float64)
        )
        result = {}
        offset = 0
        for name in self.names:
            shape = self._entries[name].shape or ()
            size = math.prod(shape)
            total = values[offset : offset + size].reshape(shape)
            count = float(values[offset + size])
            result[name] = Sum(float(total) if not shape else total.clone(), count)
            offset += size + 1
        return result

    def reduce(self) -> dict[str, Sum]:
        """Every metric summed over all ranks (a collective every rank must call)."""
        self.agree()
        return self.unpack(all_reduce_sum(self.local()))


class PendingSums:
    """Sums over all ranks, on their way: the all-reduce runs in the background and the
    result is read later (:meth:`result`), so the loop neither waits for the other ranks nor,
    on a GPU, synchronises the device.

    Every rank must create one at the same point (it starts a collective on the default
    group, in order with the gradient all-reduces).
    """

    def __init__(self, local_sums: torch.Tensor) -> None:
        self._sums = local_sums
        self._work = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._work = dist.all_reduce(local_sums, op=dist.ReduceOp.SUM, async_op=True)
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        if local_sums.device.type == "cuda":
            if self._work is not None:
                self._work.wait()  # on CUDA this orders the stream after the collective only
            self._host = torch.empty(local_sums.shape, dtype=local_sums.dtype, pin_memory=True)
            self._host.copy_(local_sums, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def result(self) -> list[float]:
        """The summed values (waits only for this reduction, normally long finished)."""
        if self._copied is not None and self._host is not None:
            self._copied.synchronize()
            return self._host.tolist()
        if self._work is not None:
            self._work.wait()
        return self._sums.tolist()


def saved_sums(sums: Sums) -> dict[str, dict[str, torch.Tensor]]:
    """Every metric summed over all ranks, as CPU tensors for a checkpoint (a collective)."""
    return {
        name: {
            "total": torch.as_tensor(summed.total, dtype=torch.float64),
            "count": torch.tensor(summed.count, dtype=torch.float64),
        }
        for name, summed in sums.reduce().items()
    }


def restore_sums(
    sums: Sums, saved: Mapping[str, Mapping[str, torch.Tensor]], carrier: bool
) -> None:
    """Add sums saved by :func:`saved_sums` into ``sums``. They are global: the ``carrier``
    rank adds them, every other rank adds zeros, so all hold the same metric names."""
    for name, values in saved.items():
        total, count = values["total"], values["count"]
        if not carrier:
            total, count = torch.zeros_like(total), torch.zeros_like(count)
        sums.add(name, total, count)


class NonFiniteWarnings:
    """Says once per metric, on rank 0 (``main``), that its value is NaN or infinite."""

    def __init__(self, main: bool) -> None:
        self.main = main
        self.said: set[str] = set()

    def observe(self, means: Mapping[str, float], step: int) -> None:
        """Warn of each metric in ``means`` (over items that exist) that is not finite."""
        for name, value in means.items():
            if not math.isfinite(value) and name not in self.said:
                self.said.add(name)
                if self.main:
                    get_logger().warning(
                        f"{name} is {value} in the metrics at step {step}: training "
                        "diverged, or a logged total holds NaN/inf. HINT: lower the learning "
                        "rate or clip gradients; check the inputs of the first such step"
                    )
