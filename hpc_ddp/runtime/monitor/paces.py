"""Where one log interval's time went, as rank 0 reads it from every rank's slot: waiting
for data, the model's forward, the wait for the gradients' all-reduce, the optimizer's steps,
checkpoint stalls and evaluation, with the rest of the step (the backward, and what is not
timed) what is left; and the two warnings that come from those figures (a rank waiting for
its data, a rank slower than the others: the one with the most time in its model's forward,
see :mod:`hpc_ddp.runtime.monitor.forward`)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from hpc_ddp.runtime.config import MonitorConfig
from hpc_ddp.runtime.monitor.datawait import DataWaitAlarm, data_wait_shares

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


#: The interval's parts (as ``interval/<part>_percent``) besides the data wait, in the order
#: a step's time passes; what they leave of 100 % is the rest of the step.
STEP_TIME_PARTS = (
    "forward", "gradient_sync", "optimizer", "stop_agreement", "checkpoint", "evaluation",
)  # fmt: skip

#: A rank's seconds in its slot for a part it did not time in the interval (no optimizer
#: step taken, no gradient all-reduce timed).
NOT_TIMED = -1.0


def timed_per_rank(per_rank: Sequence[float]) -> list[float] | None:
    """The seconds in a part of the ranks that timed it, from the slots; None where no rank
    did (a script that updates its weights by hand, a model not under DDP). A rank that did
    not time it is left out, not read as 0: under DDP every rank takes the same steps, so it
    is one whose timer could not read (it said so), and a 0 would pull the mean down."""
    timed = [value for value in per_rank if value != NOT_TIMED]
    return timed or None


@dataclass(frozen=True)
class RankTimes:
    """One interval as rank 0 sees it: its length, each rank's seconds waiting for data, in
    forward, waiting for the gradients' all-reduce, in optimizer steps and agreeing on a
    stop (None: not timed), rank 0's seconds in checkpoint stalls and evaluation."""

    seconds: float
    data_wait_s: Sequence[float] | None
    forward_s: Sequence[float] | None
    optimizer_s: Sequence[float] | None
    checkpoint_s: float
    evaluation_s: float
    gradient_sync_s: Sequence[float] | None = None
    #: Each rank's seconds agreeing on a stop (a wait for the slowest rank at each check).
    stop_agreement_s: Sequence[float] | None = None


def step_time_percent(times: RankTimes) -> dict[str, float]:
    """``<part>_percent`` of :data:`STEP_TIME_PARTS` (without ``interval/``): forward, the
    gradients' all-reduce, optimizer and the stop agreement as the ranks' mean shares,
    checkpoints and evaluation as rank 0's, each at most 100."""
    length = max(times.seconds, 1e-9)
    found = {}
    for part, per_rank in (
        ("forward", times.forward_s),
        ("gradient_sync", times.gradient_sync_s),
        ("optimizer", times.optimizer_s),
        ("stop_agreement", times.stop_agreement_s),
    ):
        if per_rank:
            mean = sum(per_rank) / len(per_rank)
            found[f"{part}_percent"] = min(100.0, 100.0 * mean / length)
    found["checkpoint_percent"] = min(100.0, 100.0 * times.checkpoint_s / length)
    found["evaluation_percent"] = min(100.0, 100.0 * times.evaluation_s / length)
    return found


class IntervalPaces:
    """Rank 0's reading of each interval's :class:`RankTimes`: the metrics, and the warnings
    of :class:`DataWaitAlarm` and :class:`StragglerAlarm`."""

    def __init__(self, settings: MonitorConfig) -> None:
        self._data_wait = DataWaitAlarm(settings.data_wait_percent)
        self._stragglers = StragglerAlarm(settings.straggler_ratio)

    def read(
        self, times: RankTimes, loader: str, hosts: Sequence[str] | None
    ) -> tuple[dict[str, float], list[str]]:
        """The interval's metrics (without ``interval/``) and the warnings to say.
        ``loader``: rank 0's loader's settings; ``hosts``: each rank's (None: not known)."""
        metrics = step_time_percent(times)
        said: list[str] = []
        if times.data_wait_s is not None:
            shares = data_wait_shares(times.data_wait_s, times.seconds)
            metrics["data_wait_percent"] = shares.mean_percent
            metrics["data_wait_percent_max"] = shares.worst_percent
            said.append(self._data_wait.observe(shares, loader) or "")
        if times.forward_s is not None:
            slowest, line = self._stragglers.metrics(times.forward_s, hosts)
            metrics.update(slowest)
            said.append(line or "")
        return metrics, [line for line in said if line]


#: The interval metrics :class:`IntervalPaces` logs: the machine's pace, not the training.
PACE_METRICS = (
    "data_wait_percent",
    "data_wait_percent_max",
    *(f"{part}_percent" for part in STEP_TIME_PARTS),
    *STRAGGLER_METRICS,
)
