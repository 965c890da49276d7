"""Where an attempt's time went, and the run's goodput over its attempts.

Each attempt's allocation (from its process's start to its end) is split into start-up
(imports, rendezvous, checks, building the model and data), the resume (loading the
checkpoint), productive steps, steps computed again after a crash (an earlier attempt had
taken them past its last checkpoint), checkpoint stalls, evaluation, the stop (from the
ranks' agreed stop to the record: the requeue and the ranks' exchange, its checkpoint left
in ``checkpoint``), the end (from ``run.finish()`` to the record, its final checkpoint
likewise left out) and the rest (the script's own work outside ``run.steps``). Goodput is
the productive steps' share of the allocation; over a run, of every attempt's allocation
together. The allocation ends when rank 0 records it: closing MLflow and the process
groups after that are not in it.

An attempt killed outright (SIGKILL, a lost node, the time limit with no warning) writes no
account; the next attempt charges it from its start to its last logged interval, unsplit
(all of it in ``other``: what it did is not known), and its steps after that attempt's
checkpoint count as redone in the next.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard

#: The parts of an attempt, in the order its time passes.
PARTS = (
    "startup", "resume", "steps", "redone", "checkpoint", "evaluation", "stop", "end", "other",
)  # fmt: skip

#: Parts every account has; records written before the stop and the end were parts of
#: their own have them in ``other`` (:func:`part_s` reads them as 0).
KEPT_SINCE_FIRST = ("startup", "resume", "steps", "redone", "checkpoint", "evaluation", "other")

#: How an attempt's ending is charged: an agreed stop, or the end after the last step.
Ending = Literal["stop", "end"]


@dataclass
class AttemptTimes:
    """Seconds this rank spent in each part the run itself can see (the loop, the
    checkpointer and the evaluation loaders add to it)."""

    resume_s: float = 0.0
    checkpoint_s: float = 0.0
    evaluation_s: float = 0.0
    #: Time inside ``run.steps`` without the checkpoints and evaluations made there.
    steps_s: float = 0.0
    #: Checkpoint and evaluation time before the first ``run.steps`` (None: not yet).
    paused_before_training_s: float | None = None
    clock: Callable[[], float] = time.perf_counter
    #: Spans being counted now: only the outermost counts (an evaluation that saves, two
    #: evaluation loaders zipped), so no second counts twice.
    _open: int = field(default=0, init=False, repr=False)
    #: Once the attempt began to end: how (stop or end), when, and the checkpoint and
    #: evaluation time then.
    _ending: tuple[Ending, float, float] | None = field(default=None, init=False, repr=False)

    @property
    def paused_s(self) -> float:
        """Checkpoint, evaluation and ending time so far (the steps' own time leaves it
        out: a stop agreed inside ``run.steps`` is not a step)."""
        return self.checkpoint_s + self.evaluation_s + self.ending_s()[1]

    def training_began(self) -> None:
        """Training begins (the first ``run.epochs``/``run.steps``): the checkpoints and
        evaluations so far were part of the start, those after are not."""
        if self.paused_before_training_s is None:
            self.paused_before_training_s = self.checkpoint_s + self.evaluation_s

    def begin_ending(self, how: Ending) -> None:
        """The attempt begins to end (the ranks agreed to stop, or ``run.finish()``); what
        follows is charged to ``how``, less its checkpoints and evaluations. Only the first
        call counts: a stop's end is part of the stop."""
        if self._ending is None:
            self._ending = (how, self.clock(), self.checkpoint_s + self.evaluation_s)

    def ending_s(self) -> tuple[Ending, float]:
        """How the attempt is ending and the seconds since it began to (0 before)."""
        if self._ending is None:
            return "end", 0.0
        how, began, paused = self._ending
        spent = self.clock() - began - (self.checkpoint_s + self.evaluation_s - paused)
        return how, max(0.0, spent)

    def add_steps(self, seconds: float, paused_before: float) -> None:
        """``seconds`` inside ``run.steps`` as steps, less the checkpoints and evaluations
        made there (:attr:`paused_s` was ``paused_before`` when they began)."""
        if self.paused_before_training_s is None:
            self.paused_before_training_s = paused_before
        self.steps_s += max(0.0, seconds - (self.paused_s - paused_before))

    @contextmanager
    def counting(
        self,
        part: Literal["resume", "checkpoint", "evaluation"],
    ) -> Iterator[None]:
        """The time inside counted as ``part``, unless it is inside another span."""
        clock = self.clock
        started, outermost = clock(), self._open == 0
        self._open += 1
        try:
            yield
        finally:
            self._open -= 1
            if outermost:
                name = f"{part}_s"
                setattr(self, name, getattr(self, name) + clock() - started)


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
) -> dict[str, float]:
    """One attempt's seconds per part (:data:`PARTS`, as ``<part>_s``), its allocation and
    goodput (%). ``timeline``: the attempt's marks (process_start_unix or entry_unix, and
    training_unix once it trained); ``steps_taken``: optimizer steps in this attempt, of
    which ``steps_redone`` were taken before."""
    start = timeline.get("process_start_unix", timeline.get("entry_unix", end_unix))
    allocation = max(0.0, end_unix - start)
    training = timeline.get("training_unix", end_unix)
    redone = times.steps_s * steps_redone / steps_taken if steps_taken else 0.0
    before_training = times.paused_before_training_s
    paused_before = times.paused_s if before_training is None else before_training
    how, ending = times.ending_s()
    parts = {
        "startup_s": max(0.0, training - start - times.resume_s - paused_before),
        "resume_s": times.resume_s,
        "steps_s": times.steps_s - redone,
        "redone_s": redone,
        "checkpoint_s": times.checkpoint_s,
        "evaluation_s": times.evaluation_s,
        "stop_s": ending if how == "stop" else 0.0,
        "end_s": ending if how == "end" else 0.0,
    }
    parts["other_s"] = max(0.0, allocation - sum(parts.values()))
    return {
        **{name: round(value, 3) for name, value in parts.items()},
        "allocation_s": round(allocation, 3),
        "goodput_percent": round(100.0 * parts["steps_s"] / allocation, 2) if allocation else 0.0,
    }


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
    allocation = totals["allocation_s"]
    queued = 0.0
    for earlier, later in itertools.pairwise(attempts):
        ended, began = earlier.get("end_unix"), later.get("start_unix")
        if is_number(ended) and is_number(began):
            queued += max(0.0, float(began) - float(ended))
    return {
        **totals,
        "goodput_percent": round(100.0 * totals["steps_s"] / allocation, 2) if allocation else 0.0,
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
    """An attempt's parts in one line: "41.2 s: startup 5.1, resume 0.3, ... goodput 73%"."""
    parts = ", ".join(
        f"{name} {part_s(account, name):.1f}" for name in PARTS if f"{name}_s" in account
    )
    return (
        f"{float(account['allocation_s']):.1f} s: {parts}; "
        f"goodput {float(account['goodput_percent']):.0f}%"
    )
