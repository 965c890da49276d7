"""Logging: the rank in every line; progress from rank 0 only (a bar on a TTY, else lines)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import TextIO

LOGGER_NAME = "hpc_ddp"


def setup_logging(rank: int, world_size: int, level: int = logging.INFO) -> logging.Logger:
    """Configure the package logger so that every line says which rank wrote it."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
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


class Progress:
    """Rank 0's progress: a redrawn bar on a terminal, one log line per interval otherwise.

    Batch logs stay readable because the bar is never written when stderr is not a TTY.
    """

    def __init__(
        self, total_steps: int | None, enabled: bool, stream: TextIO | None = None
    ) -> None:
        self.total_steps = total_steps
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.is_tty = enabled and self.stream.isatty()

    def update(
        self, step: int, epoch: int, metrics: Mapping[str, float], samples_per_s: float
    ) -> None:
        if not self.enabled:
            return
        total = f"/{self.total_steps}" if self.total_steps else ""
        values = "".join(f" {name} {value:.4f}" for name, value in metrics.items())
        text = f"epoch {epoch} step {step}{total}{values} {samples_per_s:,.0f} samples/s"
        if self.is_tty:
            width = 30
            filled = int(width * step / max(1, self.total_steps or step))
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}")
            self.stream.flush()
        else:
            get_logger().info(text)

    def close(self) -> None:
        if self.is_tty:
            self.stream.write("\n")
            self.stream.flush()
