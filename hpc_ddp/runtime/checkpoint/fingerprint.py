"""What a resume must find unchanged: the values a run names as its fingerprint."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.errors import HpcDdpError

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def fingerprint_of(values: Mapping[str, Any]) -> dict[str, str]:
    """``values`` as a checkpoint keeps them: each value's repr, so any type compares. A repr
    that holds a memory address differs in every process (every resume would be refused):
    refused at the start, naming the key."""
    kept = {key: repr(value) for key, value in values.items()}
    for key, text in kept.items():
        if _ADDRESS.search(text):
            raise HpcDdpError(
                f"fingerprint value {key!r} ({type(values[key]).__name__}) is shown with a "
                f"memory address ({text[:60]}): it differs in every process, and every "
                "resume would be refused",
                "pass plain values (numbers, strings, lists of them), e.g. a model's "
                "settings rather than the model",
            )
    return kept


def check_resumable(saved: Mapping[str, str], current: Mapping[str, str], path: Path) -> None:
    """Refuse a resume whose fingerprint (see :func:`fingerprint_of`) changed, naming every
    change."""
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
