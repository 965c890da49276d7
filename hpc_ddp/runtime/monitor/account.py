"""Where an attempt's time went, and the run's goodput over its attempts.

Each attempt's allocation (from its start, its batch job's or its process's, to its end; see
:func:`attempt_start_unix`) is split into start-up
(imports, rendezvous, checks, building the model and data), the resume (loading the
checkpoint), productive steps, steps computed again after a crash (an earlier attempt had
taken them past its last checkpoint), checkpoint stalls, evaluation, the stop (from the
ranks' agreed stop to the record: the requeue and the ranks' exchange, its checkpoint left
in ``checkpoint``), the end (from ``run.finish()`` to the record, its final checkpoint
likewise left out), the time the process did not run (``suspended``: ``scontrol suspend``,
gang scheduling, SIGSTOP or a host that hung, as the stall watchdog's looks find it, taken
out of the part it fell in) and the rest (the script's own work outside ``run.steps``).

The allocation ends when rank 0 records it: closing MLflow and the process groups after
that are not in it. Goodput is the productive steps' share of the allocation; over a run,
of every attempt's allocation together. Suspended time stays in the allocation: rank 0 cannot
tell a suspension Slurm leaves out of the job's run time from a SIGSTOP or a hung host,
which it charges (the other ranks hold their devices meanwhile).

An attempt killed outright (SIGKILL, a lost node, the time limit with no warning) writes no
account; the next attempt charges it from its start to its last logged interval, unsplit
(all of it in ``other``: what it did is not known), and its steps after that attempt's
checkpoint count as redone in the next.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

from hpc_ddp.runtime.monitor.attempt_times import AttemptTimes, EndingReading

#: The parts of an attempt, in the order its time passes.
PARTS = (
    "startup", "resume", "steps", "redone", "checkpoint", "evaluation", "stop", "end",
    "suspended", "other",
)  # fmt: skip

#: Parts every account has; records written before the stop, the end and suspensions were
#: parts of their own have them in ``other`` or the part they fell in (:func:`part_s` reads
#: them as 0).
KEPT_SINCE_FIRST = ("startup", "resume", "steps", "redone", "checkpoint", "evaluation", "other")


def redone_steps(earlier_last_step: int | None, from_step: int, last_step: int) -> int:
    """Steps this attempt took again: the earlier attempt had passed ``from_step`` (the
    checkpoint this one resumed from) and reached ``earlier_last_step`` before it ended."""
    if earlier_last_step is None:
        return 0
    return max(0, min(earlier_last_step, last_step) - from_step)


def attempt_account(
    timeline: Mapping[str, float],
    end_unix: float,
    times: AttemptTimes,
    steps_taken: int,
    steps_redone: int,
    reading: EndingReading | None = None,
) -> dict[str, float]:
    """One attempt's seconds per part (:data:`PARTS`, as ``<part>_s``), its allocation and
    goodput (%). ``timeline``: the attempt's marks (its start, :func:`attempt_start_unix`,
    and training_unix once it trained); ``steps_taken``: optimizer steps in this attempt, of
    which ``steps_redone`` were taken before; ``reading``: ``times.reading()`` taken before
    ``end_unix`` (now, when not given)."""
    start = attempt_start_unix(timeline, end_unix)
    allocation = max(0.0, end_unix - start)
    training = timeline.get("training_unix", end_unix)
    redone = times.steps_s * steps_redone / steps_taken if steps_taken else 0.0
    before_training = times.paused_before_training_s
    reading = times.reading() if reading is None else reading
    paused_before = reading.paused_s if before_training is None else before_training
    how, ending = reading.how, reading.ending_s
    suspended = min(reading.suspended_s, allocation)
    suspended_before = suspended if before_training is None else times.suspended_before_training_s
    parts = {
        "startup_s": max(0.0, training - start - times.resume_s - paused_before - suspended_before),
        "resume_s": times.resume_s,
        "steps_s": times.steps_s - redone,
        "redone_s": redone,
        "checkpoint_s": times.checkpoint_s,
        "evaluation_s": times.evaluation_s,
        "stop_s": ending if how == "stop" else 0.0,
        "end_s": ending if how == "end" else 0.0,
        "suspended_s": suspended,
    }
    parts["other_s"] = max(0.0, allocation - sum(parts.values()))
    return {
        **{name: round(value, 3) for name, value in parts.items()},
        "allocation_s": round(allocation, 3),
        "goodput_percent": goodput_percent(parts["steps_s"], allocation),
    }


def attempt_start_unix(timeline: Mapping[str, float], default: float) -> float:
    """When the attempt's allocation began: the job's start where Slurm's is this attempt's,
    else its process's start, else the toolkit's entry (``default`` with none of them)."""
    for mark in ("allocation_start_unix", "process_start_unix", "entry_unix"):
        if mark in timeline:
            return timeline[mark]
    return default


def goodput_percent(steps_s: float, allocation_s: float) -> float:
    """The productive steps' share of the allocation, in % (0 when there was none)."""
    return round(100.0 * steps_s / allocation_s, 2) if allocation_s > 0 else 0.0


def unsplit_account(allocation_s: float) -> dict[str, float]:
    """The account of an attempt killed before it could write its own: its time to its last
    sign of life, in ``other``."""
    parts = {f"{part}_s": 0.0 for part in PARTS}
    parts["other_s"] = round(max(0.0, allocation_s), 3)
    return {**parts, "allocation_s": parts["other_s"], "goodput_percent": 0.0}


def is_account(value: object) -> TypeGuard[dict[str, Any]]:
    """Whether ``value`` is an attempt's account as :func:`attempt_account` writes it (a
    record edited by hand or cut short is passed over, never a reason to fail)."""
    keys = (*(f"{part}_s" for part in KEPT_SINCE_FIRST), "allocation_s", "goodput_percent")
    return isinstance(value, dict) and all(is_number(value.get(key)) for key in keys)


def part_s(account: Mapping[str, Any], part: str) -> float:
    """Seconds of ``part`` in an account :func:`is_account` took (0 where an older record
    has no such part)."""
    value = account.get(f"{part}_s", 0.0)
    return float(value) if is_number(value) else 0.0


def is_number(value: object) -> TypeGuard[int | float]:
    """A JSON number (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def run_account(attempts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The run over its attempts (attempts.json's entries; an attempt killed before it logged
    an interval, or before start times were kept, has no ``account`` and is only counted):
    each part's seconds summed, the allocation, goodput, rank-hours charged (a GPU job's
    GPU-hours: one GPU a rank) and the time waited in the queue between attempts."""
    accounts = [
        (attempt["account"], attempt.get("ranks", 1))
        for attempt in attempts
        if is_account(attempt.get("account")) and is_number(attempt.get("ranks", 1))
    ]
    totals = {
        f"{part}_s": round(sum(part_s(account, part) for account, _ in accounts), 3)
        for part in (*PARTS, "allocation")
    }
    queued = 0.0
    for earlier, later in itertools.pairwise(attempts):
        ended, began = earlier.get("end_unix"), later.get("start_unix")
        if is_number(ended) and is_number(began):
            queued += max(0.0, float(began) - float(ended))
    return {
        **totals,
        "goodput_percent": goodput_percent(totals["steps_s"], totals["allocation_s"]),
        "rank_hours": round(
            sum(float(a["allocation_s"]) * float(n) for a, n in accounts) / 3600, 4
        ),
        "queued_s": round(queued, 3),
        "attempts": len(attempts),
        "attempts_unaccounted": len(attempts) - len(accounts),
    }


def goodput_metrics(account: Mapping[str, Any]) -> dict[str, float]:
    """What the tracker records of a run's account at an attempt's end."""
    return {
        "goodput_percent": float(account["goodput_percent"]),
        "rank_hours": float(account["rank_hours"]),
    }


def account_line(account: Mapping[str, Any]) -> str:
    """An attempt's parts in one line: "41.2 s: startup 5.1, resume 0.3, ... goodput 73%"
    (``suspended`` only where the process was)."""
    shown = [
        name
        for name in PARTS
        if f"{name}_s" in account and (name != "suspended" or part_s(account, name) > 0)
    ]
    parts = ", ".join(f"{name} {part_s(account, name):.1f}" for name in shown)
    return (
        f"{float(account['allocation_s']):.1f} s: {parts}; "
        f"goodput {float(account['goodput_percent']):.0f}%"
    )
