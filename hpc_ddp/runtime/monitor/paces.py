"""Where one log interval's time went, as rank 0 reads it from every rank's slot: waiting
for data, the model's forward, checkpoint stalls and evaluation, with the rest of the step
(backward, optimizer, waiting for the other ranks) what is left; and the two warnings that
come from those figures (a rank waiting for its data, a rank slower than the others)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hpc_ddp.runtime.config import MonitorConfig
from hpc_ddp.runtime.monitor.datawait import DataWaitAlarm, data_wait_shares
from hpc_ddp.runtime.monitor.straggler import STRAGGLER_METRICS, StragglerAlarm

#: The interval's parts (as ``interval/<part>_percent``) besides the data wait, in the order
#: a step's time passes; what they leave of 100 % is the rest of the step.
STEP_TIME_PARTS = ("forward", "checkpoint", "evaluation")


@dataclass(frozen=True)
class RankTimes:
    """One interval as rank 0 sees it: its length, each rank's seconds waiting for data and
    in forward (None: not timed), rank 0's seconds in checkpoint stalls and evaluation."""

    seconds: float
    data_wait_s: Sequence[float] | None
    forward_s: Sequence[float] | None
    checkpoint_s: float
    evaluation_s: float


def step_time_percent(times: RankTimes) -> dict[str, float]:
    """``<part>_percent`` of :data:`STEP_TIME_PARTS` (without ``interval/``): forward as the
    ranks' mean share, checkpoints and evaluation as rank 0's, each at most 100."""
    length = max(times.seconds, 1e-9)
    found = {}
    if times.forward_s:
        mean = sum(times.forward_s) / len(times.forward_s)
        found["forward_percent"] = min(100.0, 100.0 * mean / length)
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
