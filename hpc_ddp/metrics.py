"""Training and validation metrics summed across ranks: exact, and off the hot path."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hpc_ddp.dist import all_reduce_sum

#: Per-batch losses Totals holds before summing them (bounds its memory on long intervals).
PENDING_LOSSES_MAX = 1024


@dataclass
class Totals:
    """Summed loss, correct predictions and sample count, as one device tensor for one reduce.

    The hot loop never synchronises and launches as few kernels as it can: it keeps each
    batch's detached mean loss (no kernel) and sums them all at once when a reduction needs
    them; the count is a host integer; only the opt-in correct count (train.train_accuracy)
    adds kernels per batch.
    """

    values: torch.Tensor
    count: int = 0
    _pending_losses: list[torch.Tensor] = field(default_factory=list, repr=False)
    _pending_sizes: list[int] = field(default_factory=list, repr=False)
    # A view of values[1], made once, so the add is one in-place kernel with no indexing.
    _correct: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._correct = self.values[1]

    @classmethod
    def zeros(cls, device: torch.device) -> Totals:
        return cls(torch.zeros(3, dtype=torch.float64, device=device))

    def add(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        mean_loss: torch.Tensor,
        count_correct: bool = True,
    ) -> None:
        count = labels.numel()
        self._pending_losses.append(mean_loss.detach())
        self._pending_sizes.append(count)
        if len(self._pending_losses) >= PENDING_LOSSES_MAX:
            self._sum_pending()
        if count_correct:
            self._correct.add_(logits.argmax(dim=1).eq(labels).sum())
        self.count += count

    def _sum_pending(self) -> None:
        """Fold the kept per-batch losses, weighted by batch size, into values[0]."""
        if not self._pending_losses:
            return
        losses = torch.stack(self._pending_losses).to(torch.float64)
        sizes = torch.tensor(self._pending_sizes, dtype=torch.float64).to(losses.device)
        self.values[0] += losses @ sizes
        self._pending_losses.clear()
        self._pending_sizes.clear()

    def absorb(self, other: Totals) -> None:
        other._sum_pending()
        self.values += other.values
        self.count += other.count

    def local_sums(self) -> torch.Tensor:
        """This rank's [loss sum, correct, count], as a new tensor."""
        self._sum_pending()
        values = self.values.clone()
        values[2] += self.count
        return values

    def global_sums(self) -> torch.Tensor:
        """The sums over all ranks (a collective every rank must call)."""
        return all_reduce_sum(self.local_sums())

    def reduced(self) -> tuple[float, float, int]:
        """(mean loss, accuracy, samples) over all ranks; a collective every rank must call."""
        loss_sum, correct, count = self.global_sums().tolist()
        if count == 0:
            return float("nan"), float("nan"), 0
        return loss_sum / count, correct / count, int(count)


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
