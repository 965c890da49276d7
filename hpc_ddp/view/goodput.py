"""`hpc-ddp plot RUN --goodput`: where each attempt's allocation went, as a PNG: one bar per
attempt, placed at its start on the run's clock (the gaps between bars: the job waiting in
the queue, or the time a killed attempt ran after its last logged interval), split into the
parts of its account, in the order they mostly come (the steps redone after a resume before
the new ones)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.monitor.account import is_account, is_number, part_s, run_account
from hpc_ddp.runtime.preempt.progress import read_attempts
from hpc_ddp.view.plot import figure_class, write_figure
from hpc_ddp.view.runs import RunView

#: Each part's colour, the same in every picture: productive steps green, work lost red.
PART_COLOURS = {
    "startup": "#9e9e9e",
    "resume": "#64b5f6",
    "steps": "#43a047",
    "redone": "#e53935",
    "checkpoint": "#fb8c00",
    "evaluation": "#8e24aa",
    "stop": "#fdd835",
    "end": "#6d4c41",
    "suspended": "#4dd0e1",
    "other": "#d7ccc8",
}

#: The parts in the order a bar draws them: an attempt's redone steps are its first ones.
DRAWN = (
    "startup", "resume", "redone", "steps", "checkpoint", "evaluation", "stop", "end",
    "suspended", "other",
)  # fmt: skip

#: The legend's name for an attempt killed outright, drawn hatched in one piece.
KILLED = "killed, not split"


@dataclass(frozen=True)
class AttemptBar:
    """One attempt on the run's clock: where its bar starts (seconds after the first
    attempt's start) and its parts' seconds (empty: no account)."""

    number: int
    start_s: float
    parts: dict[str, float]
    label: str
    #: Killed outright: its time is known only as a whole ("other", not split).
    unsplit: bool


def attempt_bars(attempts: Sequence[Mapping[str, Any]]) -> list[AttemptBar]:
    """The bars of attempts.json's entries. An entry with no start time (a record from before
    they were kept) is placed at the end of the one before: its queue wait is not known."""
    starts = [float(a["start_unix"]) for a in attempts if is_number(a.get("start_unix"))]
    origin = min(starts) if starts else 0.0
    bars: list[AttemptBar] = []
    next_free = 0.0
    for number, attempt in enumerate(attempts, 1):
        account = attempt.get("account")
        start = attempt.get("start_unix")
        start_s = float(start) - origin if is_number(start) else next_free
        parts = {part: part_s(account, part) for part in DRAWN} if is_account(account) else {}
        unsplit = attempt.get("status") == "killed"
        step = attempt.get("last_step")
        if not parts:
            why = (
                "killed before it could write one"
                if attempt.get("status")
                else "running, or ended unseen"
            )
            label = f"attempt {number}: no account ({why})"
        elif unsplit:
            label = f"attempt {number}: killed, last logged at step {step}, not split"
        else:
            goodput = float(account["goodput_percent"])  # type: ignore[index]
            label = (
                f"attempt {number}: {attempt.get('status')} at step {step}, goodput {goodput:.0f}%"
            )
        bars.append(AttemptBar(number, start_s, parts, label, unsplit))
        next_free = start_s + sum(parts.values())
    return bars


def time_unit(span_s: float) -> tuple[str, float]:
    """The unit the axis reads best in for a run that spans ``span_s`` seconds."""
    if span_s >= 3 * 3600:
        return "h", 3600.0
    if span_s >= 3 * 60:
        return "min", 60.0
    return "s", 1.0


def plot_goodput(run: RunView) -> Any:
    """A matplotlib Figure of the run's attempts (:func:`attempt_bars`), with the run's
    goodput, rank-hours and queue wait in its title."""
    attempts = read_attempts(run.path)
    if not any(is_account(attempt.get("account")) for attempt in attempts):
        raise HpcDdpError(
            f"run {run.name}/{run.run_id} has no time account yet ({run.path})",
            "each attempt writes its account when it ends; plot it after the first one ends",
        )
    bars = attempt_bars(attempts)
    span = max(bar.start_s + sum(bar.parts.values()) for bar in bars)
    unit, seconds = time_unit(span)
    figure = figure_class()(figsize=(11, 1.6 + 0.55 * len(bars)), layout="constrained")
    axes = figure.add_subplot(1, 1, 1)
    labelled: set[str] = set()
    for bar in bars:
        left = bar.start_s
        row = -bar.number  # the first attempt on top
        for part, value in bar.parts.items():
            if value <= 0:
                continue
            name = KILLED if bar.unsplit else part
            axes.barh(
                row, value / seconds, left=left / seconds, height=0.6,
                color=PART_COLOURS[part], edgecolor="black" if bar.unsplit else "none",
                hatch="//" if bar.unsplit else None, linewidth=0.5,
                label=None if name in labelled else name,
            )  # fmt: skip
            labelled.add(name)
            left += value
        if not sum(bar.parts.values()):  # no account, or no time in it: a mark where it began
            axes.plot([left / seconds], [row], "x", color="black", markersize=8)
    axes.set_yticks([-bar.number for bar in bars], [bar.label for bar in bars])
    axes.set_xlabel(
        f"{unit} since the first attempt began (gaps: the queue, or a killed attempt's time "
        "after its last log)"
    )
    axes.set_xlim(left=0)
    axes.grid(axis="x", alpha=0.3)
    order = [*DRAWN, KILLED]
    handles, labels = axes.get_legend_handles_labels()
    ranked = sorted(zip(labels, handles, strict=True), key=lambda pair: order.index(pair[0]))
    figure.legend(
        [handle for _label, handle in ranked], [label for label, _handle in ranked],
        fontsize="small", ncols=len(ranked), loc="outside lower center",
    )  # fmt: skip
    total = run_account(attempts)
    allocated = f"{total['allocation_s'] / seconds:.3g} {unit} allocated"
    if total["suspended_s"] > 0:
        allocated += f" ({total['suspended_s'] / seconds:.3g} {unit} of it suspended)"
    figure.suptitle(
        f"{run.name}/{run.run_id}: goodput {total['goodput_percent']:.0f}% of {allocated}, "
        f"{total['rank_hours']:.3g} rank-hours, {total['queued_s'] / seconds:.3g} {unit} queued"
    )
    return figure


def save_goodput_plot(run: RunView, output: Path | None = None) -> Path:
    """Write the run's attempts as a PNG (default ``<run dir>/goodput.png``); returns its path."""
    return write_figure(plot_goodput(run), output or run.path / "goodput.png")
