"""The slowest rank of each log interval, from every rank's time in its model's forward
(see :mod:`hpc_ddp.runtime.monitor.forward`), and one warning for a rank that stays slow."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

#: Intervals in a row a rank must be the straggler before it is named in a warning (one
#: slow interval is a hiccup: a page fault storm, a neighbour's burst).
INTERVALS_BEFORE_SAYING = 3


@dataclass(frozen=True)
class Slowest:
    """One interval's slowest rank: its forward seconds against the median rank's."""

    rank: int
    seconds: float
    median_s: float

    @property
    def ratio(self) -> float:
        return self.seconds / self.median_s


def slowest_rank(per_rank_s: Sequence[float]) -> Slowest | None:
    """The rank with the most forward time (the lowest such rank on a tie); None with one
    rank or where the median rank spent no time in forward (nothing to compare)."""
    if len(per_rank_s) < 2:
        return None
    median = statistics.median(per_rank_s)
    if median <= 0:
        return None
    rank = max(range(len(per_rank_s)), key=lambda index: (per_rank_s[index], -index))
    return Slowest(rank, per_rank_s[rank], median)


class StragglerAlarm:
    """Names, once per rank, a rank whose forward takes more than ``ratio`` times the median
    rank's for :data:`INTERVALS_BEFORE_SAYING` intervals in a row."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self._rank: int | None = None
        self._in_a_row = 0
        self._said: set[int] = set()

    def observe(self, slowest: Slowest | None, host: str | None) -> str | None:
        """The warning to say after this interval, if any."""
        if slowest is None or slowest.ratio <= self.ratio:
            self._rank, self._in_a_row = None, 0
            return None
        if slowest.rank != self._rank:
            self._rank, self._in_a_row = slowest.rank, 0
        self._in_a_row += 1
        if self._in_a_row < INTERVALS_BEFORE_SAYING or slowest.rank in self._said:
            return None
        self._said.add(slowest.rank)
        where = f" on {host}" if host else ""
        return (
            f"rank {slowest.rank}{where} is the slowest for {self._in_a_row} log intervals in "
            f"a row: its model's forward took {slowest.ratio:.2f}x the median rank's "
            f"({slowest.seconds:.3g} s against {slowest.median_s:.3g} s in the last interval; "
            f"monitor.straggler_ratio={self.ratio:g}), and every rank's step waits for it. "
            "HINT: a larger share of the data on that rank (uneven batches or sequence "
            "lengths), or a slow node: compare its GPU's clocks and temperature "
            f"(system/<host>/gpu<N>/..., nvidia-smi -q{' on ' + host if host else ''}); "
            "leave a bad node out with sbatch --exclude=<node>"
        )

    def metrics(
        self, per_rank_s: Sequence[float], hosts: Sequence[str] | None
    ) -> tuple[dict[str, float], str | None]:
        """One interval's ``slowest_rank`` and ``slowest_rank_ratio`` (without
        ``interval/``; none with one rank or no forward timed), and the warning to say."""
        slowest = slowest_rank(per_rank_s)
        if slowest is None:
            return {}, self.observe(None, None)
        host = hosts[slowest.rank] if hosts else None
        found = {"slowest_rank": float(slowest.rank), "slowest_rank_ratio": slowest.ratio}
        return found, self.observe(slowest, host)


#: The interval metrics :class:`StragglerAlarm` logs: the machine's pace, not the training.
STRAGGLER_METRICS = ("slowest_rank", "slowest_rank_ratio")
