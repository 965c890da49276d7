"""The step-time panel of `hpc-ddp plot`: where each log interval's time went, stacked to
100 %: waiting for data, the forward, the wait for the gradients' all-reduce, the
optimizer's steps and the agreement on a stop (the ranks' means), checkpoint stalls and
evaluation (rank 0's), and the rest of the step (the backward, and what of the step was not
timed)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.monitor.account import is_number
from hpc_ddp.runtime.monitor.paces import STRAGGLER_METRICS
from hpc_ddp.runtime.tracking.record import read_metrics
from hpc_ddp.view.attempt_marks import with_headroom

#: The recorded parts, bottom to top, with their labels; the rest of the step (the
#: backward) goes between the forward and the wait for the gradients.
RECORDED = (
    ("interval/data_wait_percent", "waiting for data"),
    ("interval/forward_percent", "forward"),
    ("interval/gradient_sync_percent", "waiting for the gradients' all-reduce"),
    ("interval/optimizer_percent", "optimizer"),
    ("interval/stop_agreement_percent", "agreeing on a stop"),
    ("interval/checkpoint_percent", "checkpoint stalls"),
    ("interval/evaluation_percent", "evaluation"),
)
REST_WHOLE = "the step"
#: An interval's rates: one logged with them but without its parts (its process did not
#: run for part of it) is drawn blank.
RATES = ("interval/samples_per_s", "interval/steps_per_s")


def rest_label(forward: bool, gradient_sync: bool, optimizer: bool) -> str:
    """The rest band's label: the backward and the parts of the step not timed."""
    if not (forward or gradient_sync or optimizer):
        return REST_WHOLE
    untimed = [] if forward else ["forward"]
    untimed.append("backward")
    untimed += [] if optimizer else ["optimizer"]
    untimed += [] if gradient_sync else ["waits for ranks"]
    return ", ".join(untimed) + " and the rest"


def step_time_series(run_dir: Path) -> tuple[list[float], dict[str, list[float]]]:
    """(the steps of the intervals that recorded their parts, label -> % at each), bottom
    to top; a part never recorded is left out, one not recorded at a step is 0 there. A
    later interval with its rates but not its parts (suspended) is 0 in every part."""
    steps: list[float] = []
    split: list[bool] = []
    recorded: dict[str, list[float]] = {name: [] for name, _label in RECORDED}
    for entry in read_metrics(run_dir):
        metrics = entry["metrics"]
        parts = "interval/checkpoint_percent" in metrics
        if not parts and not (steps and any(name in metrics for name in RATES)):
            continue
        steps.append(float(entry["step"]))
        split.append(parts)
        for name in recorded:
            value = finite(metrics.get(name)) if parts else None
            recorded[name].append(0.0 if value is None else value)
    if not steps:
        return [], {}
    rest = [
        max(0.0, 100.0 - sum(parts)) if known else 0.0
        for known, parts in zip(split, zip(*recorded.values(), strict=True), strict=True)
    ]
    rest_name = rest_label(
        any(recorded["interval/forward_percent"]),
        any(recorded["interval/gradient_sync_percent"]),
        any(recorded["interval/optimizer_percent"]),
    )
    series: dict[str, list[float]] = {}
    for name, label in RECORDED:
        if name == "interval/gradient_sync_percent":
            series[rest_name] = rest
        if any(recorded[name]) or name == "interval/data_wait_percent":
            series[label] = recorded[name]
    return steps, series


def steps_split_line(run_dir: Path) -> str | None:
    """`hpc-ddp runs NAME/ID`'s line on where the steps' time went: each recorded part's
    mean over the log intervals that recorded their parts (each interval's figure the ranks'
    mean), the most one rank waited for data in an interval, and the rank whose forward was
    most often the slowest (None: no interval recorded its parts)."""
    intervals, sums = 0, {name: 0.0 for name, _label in RECORDED}
    worst_wait: float | None = None
    slowest: Counter[int] = Counter()
    slowest_ratio = 0.0
    for entry in read_metrics(run_dir):
        metrics = entry["metrics"]
        if "interval/checkpoint_percent" not in metrics:
            continue
        intervals += 1
        for name in sums:
            sums[name] += finite(metrics.get(name)) or 0.0
        most = finite(metrics.get("interval/data_wait_percent_max"))
        if most is not None:
            worst_wait = max(most, worst_wait or 0.0)
        rank, ratio = (finite(metrics.get(f"interval/{n}")) for n in STRAGGLER_METRICS)
        if rank is not None and ratio is not None:
            slowest[int(rank)] += 1
            slowest_ratio = max(slowest_ratio, ratio)
    if not intervals:
        return None
    means = {label: sums[name] / intervals for name, label in RECORDED if sums[name]}
    parts = [
        f"{label} {mean:.0f}%" if mean >= 0.5 else f"{label} <1%" for label, mean in means.items()
    ]
    said = f"steps' time (a mean of {intervals} log interval{'s' if intervals != 1 else ''}): "
    said += ", ".join(parts) if parts else "no part timed"
    if worst_wait is not None:
        said += f"; the most a rank waited for data: {worst_wait:.0f}% of an interval"
    if slowest:
        rank, times = slowest.most_common(1)[0]
        said += (
            f"; the slowest forward: rank {rank} in {times} of {intervals} "
            f"(at most {slowest_ratio:.2f}x the median rank's)"
        )
    return said


def finite(value: Any) -> float | None:
    """``value`` as a float where it is a finite number (a record's value may be anything)."""
    return float(value) if is_number(value) and math.isfinite(value) else None


def interval_starts(steps: Sequence[float], resumes: Sequence[int]) -> list[float]:
    """The step each interval (closed at ``steps``, superseded ones already left out) began
    at: where the one before it closed (the first: 0), or where an attempt resumed in
    between (the steps from the last interval to the stop are in no interval)."""
    starts, previous = [], 0.0
    for step in steps:
        begun = [float(resumed) for resumed in resumes if previous <= resumed < step]
        starts.append(max(begun, default=previous))
        previous = step
    return starts


def draw_step_time(
    axes: Any, steps: list[float], series: dict[str, list[float]], resumes: Sequence[int] = ()
) -> None:
    """The panel on ``axes``: the parts stacked to 100 %, each interval's over the steps it
    covers (:func:`interval_starts`, ``resumes`` the steps later attempts resumed from), so
    a run that closed one interval shows it too."""
    starts = interval_starts(steps, resumes)
    widths = [end - start for start, end in zip(starts, steps, strict=True)]
    below = [0.0] * len(steps)
    for index, (label, values) in enumerate(series.items()):
        axes.bar(starts, values, widths, below, align="edge", color=f"C{index}", alpha=0.85,
                 linewidth=0, label=label)  # fmt: skip
        below = [base + value for base, value in zip(below, values, strict=True)]
    axes.set_ylim(0, with_headroom(100.0))
    axes.set_yticks(range(0, 101, 20))
    axes.set_xlim(0, max(steps))
    axes.set_title("where each interval's time went (%, the ranks' mean)")
    axes.set_xlabel("step")
    axes.grid(alpha=0.3)
    # Below the panel: the bands fill it to 100 %, so a legend inside would hide one.
    axes.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=3)
