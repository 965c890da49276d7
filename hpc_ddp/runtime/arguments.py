"""Checks of the values a script passes to the public API, where a wrong one would otherwise
raise deep inside torch or be taken silently: one line naming the call and the value."""

from __future__ import annotations

import operator
from collections.abc import Sized
from typing import Any

from hpc_ddp.runtime.errors import HpcDdpError


def is_number(value: object) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def whole_number(value: Any, call: str, minimum: int = 1) -> int:
    """``value`` as an int when it is a whole number of at least ``minimum`` (a bool or a
    float is not); else an HpcDdpError naming ``call`` (e.g. ``run.epochs(num_epochs)``)."""
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None or number < minimum:
        kind = type(value).__name__
        raise HpcDdpError(
            f"{call}={value!r}: expected a whole number of at least {minimum}"
            + (f" (got type {kind})" if number is None else ""),
            f"pass an int >= {minimum}" + (" (int(value) for a float)" if kind == "float" else ""),
        )
    return number


def optional_whole_number(value: Any, call: str, minimum: int = 1) -> int | None:
    """None, or :func:`whole_number`'s check."""
    return None if value is None else whole_number(value, call, minimum)


def sized_dataset(dataset: Any, call: str) -> int:
    """How many samples a map-style ``dataset`` holds (the loaders shard it by index)."""
    if not isinstance(dataset, Sized):
        raise HpcDdpError(
            f"{call} got a {type(dataset).__name__} without a length (an IterableDataset?): "
            "it shards a dataset by index",
            "pass a map-style Dataset (with __len__ and __getitem__), or build your own "
            "DataLoader over the stream and give it to run.steps(...)",
        )
    return len(dataset)
