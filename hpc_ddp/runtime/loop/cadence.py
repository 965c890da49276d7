"""How often the loop checks for a stop and logs: set, or measured once from rank 0's step
rate and agreed by all ranks (both are collectives, so every rank must do them at the same
steps)."""

from __future__ import annotations

from typing import Any

from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.place.dist import broadcast_object

#: The stop-signal check period the automatic setting aims at, and its upper bound in steps.
CHECK_PERIOD_S = 1.0
CHECK_EVERY_MAX = 1000
#: With log_interval=None: the first log step, then the period aimed at and its bound.
FIRST_LOG_INTERVAL = 20
LOG_PERIOD_S = 5.0
LOG_INTERVAL_MAX = 10000


def steps_for(steps_per_s: float, seconds: float, most: int) -> int:
    """The whole number of steps, 1 to ``most``, that takes about ``seconds``."""
    return max(1, min(most, round(steps_per_s * seconds)))


class Cadence:
    """Steps between stop checks (``check_every``) and between logs (``log_interval``)."""

    def __init__(
        self, check_every: int | None, log_interval: int | None, group: Any | None, is_main: bool
    ) -> None:
        self._set = (check_every, log_interval)
        self.check_every = check_every or 1
        self.log_interval = log_interval or FIRST_LOG_INTERVAL
        self.calibrated = check_every is not None and log_interval is not None
        self._group = group
        self._is_main = is_main

    def calibrate(self, steps: int, elapsed_s: float) -> None:
        """Agree the periods left automatic from ``steps`` taken in ``elapsed_s``: stop checks
        about once per second, logs about every LOG_PERIOD_S seconds. Rank 0's rate decides."""
        rate = steps / max(1e-9, elapsed_s)
        check_every, log_interval = self._set
        periods = (
            check_every or steps_for(rate, CHECK_PERIOD_S, CHECK_EVERY_MAX),
            log_interval or steps_for(rate, LOG_PERIOD_S, LOG_INTERVAL_MAX),
        )
        self.check_every, self.log_interval = broadcast_object(periods, self._group)
        self.calibrated = True
        if self._is_main:
            get_logger().info(
                f"stop signals are checked every {self.check_every} step(s); progress and "
                f"interval metrics every {self.log_interval} step(s)"
            )
