"""Logging: the rank in every line; progress from rank 0 only (a bar on a TTY, else lines)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any, TextIO

LOGGER_NAME = "hpc_ddp"


def setup_logging(rank: int, world_size: int, level: int = logging.INFO) -> logging.Logger:
    """Configure the package logger so that every line says which rank wrote it."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.handlers.clear()
    handler = _AroundTheBar(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s [rank {rank}/{world_size}] %(levelname)s %(message)s", "%H:%M:%S"
        )
    )
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return logger


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


def adopt_logger(name: str) -> None:
    """Route library ``name``'s log lines (e.g. mlflow's) through the package's handler, so
    they carry the rank like every other line."""
    logger = logging.getLogger(name)
    logger.handlers = list(get_logger().handlers)
    logger.propagate = False


class _AroundTheBar(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes log lines above rank 0's progress bar while one is drawn, never onto it."""

    def emit(self, record: logging.LogRecord) -> None:
        if Progress.active is None:
            super().emit(record)
            return
        try:
            Progress.active.write(self.format(record), file=self.stream)  # not stdout
        except Exception:
            self.handleError(record)


class Progress:
    """Rank 0's progress: on a terminal a tqdm bar (rate, ETA, the interval's metrics) with
    log lines written above it; otherwise (batch logs) one log line per interval."""

    #: The bar being drawn, if any (log lines go around it).
    active: Any = None

    def __init__(
        self, total_steps: int | None, enabled: bool, stream: TextIO | None = None
    ) -> None:
        self.total_steps = total_steps
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.is_tty = enabled and self.stream.isatty()
        self._bar: Any = None

    def _draw(self, step: int, epoch: int, postfix: str) -> None:
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total_steps,
                initial=step,
                unit="step",
                file=self.stream,
                dynamic_ncols=True,
                # At most one redraw per tqdm's mininterval (0.1 s; TQDM_MININTERVAL sets it,
                # 0 draws at every move), since reach() may come at every step.
                miniters=1,  # the time alone decides (tqdm's own adaptive count skips draws)
                smoothing=0.1,
            )
            Progress.active = self._bar
        if self.total_steps != self._bar.total:
            self._bar.total = self.total_steps
        self._bar.set_description_str(f"epoch {epoch}", refresh=False)
        self._bar.set_postfix_str(postfix, refresh=False)
        # An interval's report may come after reach() moved the bar on: never back.
        self._bar.update(max(0, step - self._bar.n))

    def update(self, step: int, epoch: int, metrics: Mapping[str, float], rate: str) -> None:
        """Show step ``step``'s interval ``metrics`` and ``rate`` (e.g. "1,200 samples/s")."""
        if not self.enabled:
            return
        values = "".join(f" {name} {value:.4f}" for name, value in metrics.items())
        if self.is_tty:
            self._draw(step, epoch, f"{values.strip()} {rate}")
            return
        total = f"/{self.total_steps}" if self.total_steps else ""
        get_logger().info(f"epoch {epoch} step {step}{total}{values} {rate}")

    def reach(self, step: int, final: bool = False) -> None:
        """Move a drawn bar to ``step`` between interval updates (at the stop checks, about
        once a second); ``final``: the end of a pass, drawn whatever the time (a finished run
        shows 100%)."""
        if self._bar is not None and step != self._bar.n:
            self._bar.update(step - self._bar.n)
            if final:
                self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            Progress.active = None
