"""Where later attempts of a run took over, marked on the panels of `hpc-ddp plot`: a
dotted line at the step each resumed from, named in a band kept free above the readings."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.monitor.account import is_number
from hpc_ddp.runtime.preempt.progress import read_attempts

#: The share of a panel's height kept above its highest reading: the frame would hide a
#: line at the very top, and the names of later attempts are written there.
HEADROOM = 0.14
#: The rows of names in that band, and the height of each (a share of the panel's height).
NAME_ROWS, NAME_ROW_HEIGHT = 3, 0.045
#: The share of a panel's width a name needs beside the next one in its row.
NAME_WIDTH = 0.2


def with_headroom(highest: float) -> float:
    """The top of a percentage panel whose readings reach ``highest`` (at least 100)."""
    return max(highest, 100.0) / (1 - HEADROOM)


def resume_steps(run_dir: Path) -> list[tuple[int, int]]:
    """(attempt number, step it resumed from) of every attempt after the first."""
    attempts = read_attempts(run_dir)
    return [
        (number, attempt["from_step"])
        for number, attempt in enumerate(attempts, 1)
        if number > 1 and is_number(attempt["from_step"]) and isinstance(attempt["from_step"], int)
    ]


def near_right_edge(step: float, left: float, right: float) -> bool:
    """Whether the name of the line at ``step`` sits to its left (it would run off the
    panel to its right)."""
    return step > left + 0.8 * (right - left)


def name_rows(steps: list[int], left: float, right: float) -> list[int]:
    """The row (0: the top) of the name of each of ``steps`` (ascending) on a panel from
    step ``left`` to ``right``: the first row where it does not cover the row's last name,
    so that names of attempts that resumed close together stay readable (past
    :data:`NAME_ROWS` crowded names, the row whose last name ends farthest to the left)."""
    width = max(right - left, 1e-9)
    ends: list[float] = [-math.inf] * NAME_ROWS
    rows = []
    for step in steps:
        at = (step - left) / width
        start = at - NAME_WIDTH if near_right_edge(step, left, right) else at
        row = next((row for row, end in enumerate(ends) if end <= start), None)
        row = ends.index(min(ends)) if row is None else row
        ends[row] = start + NAME_WIDTH
        rows.append(row)
    return rows


def mark_attempts(axes: Any, resumes: list[tuple[int, int]]) -> None:
    """A dotted line where later attempts took over, named at the top of the panel (one
    line for attempts that resumed from the same step: a crash before the next checkpoint).
    The panel's step range reaches every line; a name near its right edge sits to its left."""
    at_step: dict[int, list[int]] = {}
    for number, step in resumes:
        at_step.setdefault(step, []).append(number)
    if not at_step:
        return
    left, right = axes.get_xlim()
    left, right = min(left, *at_step), max(right, *at_step)
    axes.set_xlim(left, right)
    steps = sorted(at_step)
    for step, row in zip(steps, name_rows(steps, left, right), strict=True):
        numbers = at_step[step]
        plural = "s" if len(numbers) > 1 else ""
        named = f"attempt{plural} {', '.join(map(str, numbers))}"
        near_right = near_right_edge(step, left, right)
        axes.axvline(step, color="0.45", linestyle=":", linewidth=1, zorder=1)
        axes.text(
            step, 0.99 - row * NAME_ROW_HEIGHT, f"{named} " if near_right else f" {named}",
            transform=axes.get_xaxis_transform(), fontsize="x-small", color="0.35", va="top",
            ha="right" if near_right else "left",
        )  # fmt: skip
