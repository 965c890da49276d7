"""What a resume must find unchanged (the values a run names as its fingerprint), and what
the ranks must hold alike at a save (digests of values, compared over the ranks)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

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


def value_digest(value: Any) -> str:
    """A digest of a plain value (numbers, strings, tensors, and dicts, lists, tuples and
    sets of them) that two ranks holding equal values compute alike: a tensor by its dtype,
    shape and bytes, a set by its members' digests in order, anything else by its repr."""
    digest = hashlib.sha256()

    def feed(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            digest.update(f"tensor {item.dtype} {tuple(item.shape)}:".encode())
            digest.update(tensor_bytes(item))
        elif isinstance(item, set | frozenset):
            digest.update(b"<" + "".join(sorted(value_digest(part) for part in item)).encode())
        elif isinstance(item, Mapping):
            digest.update(b"{")
            for key in sorted(item, key=repr):
                feed(key)
                feed(item[key])
            digest.update(b"}")
        elif isinstance(item, list | tuple):
            digest.update(b"[")
            for part in item:
                feed(part)
            digest.update(b"]")
        else:
            digest.update(repr(item).encode())

    feed(value)
    return digest.hexdigest()


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's values as bytes, whatever its layout (sparse, a conjugate view)."""
    dense = tensor.detach().cpu()
    if dense.layout != torch.strided:
        dense = dense.to_dense()
    dense = dense.resolve_conj().resolve_neg().contiguous().reshape(-1)
    return dense.view(torch.uint8).numpy().tobytes()


def rank_differences(every: list[tuple[list[str], dict[str, str]]]) -> tuple[str, list[str]]:
    """From each rank's (names registered per rank, digest of each ``run.state`` value): the
    ranks' names listed where they differ ("" where alike), and the ``run.state`` keys whose
    values differ from rank 0's."""
    names = [theirs for theirs, _ in every]
    listed = ""
    if any(theirs != names[0] for theirs in names):
        listed = "; ".join(
            f"rank {rank}: {', '.join(theirs) or 'none'}" for rank, theirs in enumerate(names)
        )
    first = every[0][1]
    keys = {key for _, digests in every for key in digests}
    differing = sorted(key for key in keys if any(d.get(key) != first.get(key) for _, d in every))
    return listed, differing
