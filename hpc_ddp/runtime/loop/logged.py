"""What ``run.log`` takes: a name that is not one of the run's own interval metrics, and a
total over a count that can be checked without a device sync; and the step
``run.log_metrics`` takes."""

from __future__ import annotations

import contextlib
import operator
from typing import SupportsIndex

import torch

from hpc_ddp.runtime.arguments import is_number
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.monitor.paces import PACE_METRICS
from hpc_ddp.runtime.monitor.throughput import THROUGHPUT_METRICS
from hpc_ddp.runtime.names import check_name

#: Interval metrics the run logs itself (as interval/<name>).
RESERVED_METRICS = frozenset(
    {"lr", "samples_per_s", "steps_per_s", *PACE_METRICS, *THROUGHPUT_METRICS}
)


def check_logged_name(name: object) -> None:
    """A name ``run.log`` can take: one MLflow takes, and not one the run logs itself."""
    check_name(name, "run.log")
    if name in RESERVED_METRICS:
        raise HpcDdpError(
            f"run.log({name!r}, ...): the run logs interval/{name} itself",
            f"log it under another name (e.g. 'my_{name}'), or with run.log_metrics()",
        )


def check_logged_value(name: str, total: torch.Tensor | float, count: torch.Tensor | float) -> None:
    """A total and count ``run.log`` can take: a number or 0-d tensor over a count above 0
    (what needs no device sync to check)."""
    if isinstance(total, torch.Tensor):
        if total.dim() != 0:
            raise HpcDdpError(
                f"run.log({name!r}, ...) got a tensor of shape {tuple(total.shape)}",
                "log a scalar (e.g. loss.detach() * batch_size); use run.sums() for tensors",
            )
    elif not is_number(total):
        raise HpcDdpError(
            f"run.log({name!r}, {total!r}, ...): the total is a {type(total).__name__}",
            "pass a number or a 0-d tensor: the metric's sum over count items",
        )
    if not isinstance(count, torch.Tensor) and not (is_number(count) and count > 0):
        raise HpcDdpError(
            f"run.log({name!r}, ..., count={count!r}): the count must be a number above 0",
            "pass how many items the total sums over (e.g. the batch's size)",
        )


def logged_step(step: object) -> int:
    """The step ``run.log_metrics`` was given, as an int: a whole number of 0 or more (a
    NumPy or 0-d tensor integer too)."""
    whole = None
    if isinstance(step, SupportsIndex) and not isinstance(step, bool):
        with contextlib.suppress(TypeError, RuntimeError):  # a float tensor; a tensor of many
            whole = operator.index(step)
    if whole is None or whole < 0:
        raise HpcDdpError(
            f"run.log_metrics(..., step={step!r}): the step must be a whole number of 0 or more",
            "pass the global step the values belong to (e.g. run.global_step), or leave it out",
        )
    return whole
