"""The time each rank waits for its next batch.

Under DDP every rank's step lasts as long as the slowest one's, so a slow loader shows as
the waiting rank's time inside the loader's ``next`` (the others wait in the gradients'
all-reduce instead). Each rank sums that time per log interval; the sums travel with the
interval's metrics (one slot per rank, no collective of their own) and rank 0 reads every
rank's share of the interval from them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

#: Intervals in a row above ``monitor.data_wait_percent`` before it is said (the first ones
#: after start or after an epoch begins hold the workers' start).
INTERVALS_BEFORE_SAYING = 3


class DataWait:
    """This rank's seconds inside the loader's ``next`` (or another wait it times) since the
    last :meth:`take`."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.seconds = 0.0
        self._clock = clock

    def next_of(self, batches: Iterator[Any], end: object) -> Any:
        """``next(batches, end)``, timed."""
        started = self._clock()
        batch = next(batches, end)
        self.seconds += self._clock() - started
        return batch

    def timed(self, call: Callable[[], T]) -> T:
        """``call()``, timed (the ranks' agreement on a stop: a wait for the slowest)."""
        started = self._clock()
        try:
            return call()
        finally:
            self.seconds += self._clock() - started

    def take(self) -> float:
        """The seconds waited since the last take (and start counting again)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


@dataclass(frozen=True)
class DataWaitShares:
    """One interval's data wait over all ranks, as shares of the interval (%)."""

    mean_percent: float
    worst_rank: int
    worst_percent: float


def data_wait_shares(per_rank_s: Sequence[float], interval_s: float) -> DataWaitShares:
    """Every rank's seconds of waiting, against the interval's length: the mean share and
    the rank that waited most (the lowest such rank on a tie)."""
    length = max(interval_s, 1e-9)
    shares = [min(100.0, 100.0 * seconds / length) for seconds in per_rank_s]
    worst = max(range(len(shares)), key=lambda rank: (shares[rank], -rank))
    return DataWaitShares(sum(shares) / len(shares), worst, shares[worst])


def loader_settings(loader: Any) -> str:
    """The settings of the torch DataLoader behind ``loader`` (run.train_loader's, or the
    user's own iterable), for the HINT; "" when there is none."""
    found = loader
    for name in ("loader", "batches"):  # run.train_loader's, a user's iterable's wrapper
        found = getattr(found, name, found)
    if not hasattr(found, "num_workers"):
        return ""
    return (
        f"num_workers={found.num_workers}, pin_memory={getattr(found, 'pin_memory', None)}, "
        f"prefetch_factor={getattr(found, 'prefetch_factor', None)}, "
        f"persistent_workers={getattr(found, 'persistent_workers', None)}"
    )


class DataWaitAlarm:
    """Says once, on rank 0, when the same rank waited for data above ``threshold_percent``
    of each of :data:`INTERVALS_BEFORE_SAYING` intervals in a row (the rank that waited most
    in each)."""

    def __init__(self, threshold_percent: float) -> None:
        self.threshold_percent = threshold_percent
        self.said = False
        self._rank = -1
        self._in_a_row = 0
        self._least_percent = 100.0

    def observe(self, shares: DataWaitShares, loader: str) -> str | None:
        """The warning line, the first time one rank's waiting has lasted; else None.
        ``loader``: rank 0's loader's settings (the ranks usually share one kind)."""
        if self.said or shares.worst_percent <= self.threshold_percent:
            self._in_a_row = 0
            return None
        if self._in_a_row == 0 or shares.worst_rank != self._rank:
            self._rank, self._in_a_row, self._least_percent = shares.worst_rank, 0, 100.0
        self._in_a_row += 1
        self._least_percent = min(self._least_percent, shares.worst_percent)
        if self._in_a_row < INTERVALS_BEFORE_SAYING:
            return None
        self.said = True
        settings = f" (rank 0's loader has {loader})" if loader else ""
        return (
            f"rank {self._rank} waited for its data at least {self._least_percent:.0f}% of "
            f"each of the last {INTERVALS_BEFORE_SAYING} log intervals (all ranks, last "
            f"interval: {shares.mean_percent:.0f}%; monitor.data_wait_percent="
            f"{self.threshold_percent:g}){settings}: every rank's step waits while its "
            "batches are made. HINT: more DataLoader workers "
            "(num_workers, about the CPUs per rank), pin_memory=True, persistent_workers=True "
            "and a larger prefetch_factor; or make the batches cheaper (decode or augment ahead)"
        )
