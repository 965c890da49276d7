"""Atomic checkpoints in <run dir>/checkpoints: write, keep the last K, load the newest good one.

A checkpoint is written to a temporary file in the same directory, flushed and fsynced, then
renamed over its final name (and the directory fsynced), so a kill at any moment leaves every
earlier checkpoint loadable. Files hold only tensors and plain data: they load with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hpc_ddp.config import Config, flatten
from hpc_ddp.errors import HpcDdpError
from hpc_ddp.logs import get_logger

FORMAT_VERSION = 1
_NAME = re.compile(r"^step-(\d{9})\.pt$")
#: Config keys that may change between attempts without breaking a resume.
RESUME_SAFE_PREFIXES = (
    "train.epochs",
    "train.log_interval",
    "train.max_steps",
    "tracking.",
    "dist.",
    "checkpoint.",
    "preempt.",
    "run.output_dir",
    "run.id",
    "run.name",
    "data.num_workers",
)


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def resume_fingerprint(config: Config) -> dict[str, str]:
    """The config values a resume depends on (model shape, data, optimizer, batch, seed)."""
    return {
        key: repr(value)
        for key, value in sorted(flatten(config).items())
        if not key.startswith(RESUME_SAFE_PREFIXES)
    }


def check_resumable(saved: Mapping[str, str], current: Mapping[str, str], path: Path) -> None:
    """Refuse a resume whose config changed in a way that matters, naming every change."""
    changed = [
        f"{key}: {saved.get(key, '<absent>')} -> {current.get(key, '<absent>')}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    ]
    if changed:
        raise HpcDdpError(
            f"cannot resume from {path}: the config changed in ways that break resuming: "
            + "; ".join(changed),
            "restore those values, or start a fresh run with another run.id (or "
            "checkpoint.resume=false); epochs, log interval, tracking, dist and checkpoint "
            "settings may change freely",
        )


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoints in ``directory``, newest (highest step) first."""
    if not directory.is_dir():
        return []
    found = [path for path in directory.iterdir() if _NAME.match(path.name)]
    return sorted(found, key=lambda path: path.name, reverse=True)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def save_checkpoint(state: Mapping[str, Any], directory: Path, step: int, keep_last: int) -> Path:
    """Write ``state`` atomically as step-<step>.pt; keep only the newest ``keep_last``."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step-{step:09d}.pt"
    temporary = directory / f".{final.name}.tmp-{os.getpid()}"
    with open(temporary, "wb") as handle:
        torch.save(dict(state), handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, final)
    _fsync_directory(directory)
    for old in list_checkpoints(directory)[keep_last:]:
        old.unlink(missing_ok=True)
    return final


def remove_partial_writes(directory: Path) -> None:
    """Temporary files left by a writer that was killed mid-save."""
    if directory.is_dir():
        for path in directory.glob(".step-*.pt.tmp-*"):
            path.unlink(missing_ok=True)


def load_newest(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads; a corrupt or truncated one is reported and skipped."""
    log = get_logger()
    for path in list_checkpoints(directory):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
                raise ValueError("not an hpc_ddp checkpoint of format 1")
        except Exception as error:  # a damaged file can fail in many ways; all mean: skip it
            log.warning(
                f"checkpoint {path} cannot be loaded ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}); trying the previous one"
            )
            continue
        return path, state
    return None
