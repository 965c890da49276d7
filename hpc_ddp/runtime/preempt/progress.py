"""The attempts of a requeued job and the step each resumed from (``attempts.json`` in the run
directory, rank 0's): attempts that end without moving the checkpoint forward (preempted or
killed before their first save) are counted, and past
``preempt.max_attempts_without_progress`` in a row the job ends instead of training again.
Each attempt that ends with a chance to say so adds how it ended and where its time went
(:mod:`hpc_ddp.runtime.monitor.account`). Standard library only."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.errors import EXIT_NO_PROGRESS, HpcDdpError
from hpc_ddp.runtime.monitor.account import (
    AttemptTimes,
    attempt_account,
    redone_steps,
    run_account,
)
from hpc_ddp.runtime.safefiles import read_records, write_records

RECORD = "attempts.json"


def record_attempt(
    run_dir: Path, job: str | None, restart_count: int, from_step: int
) -> list[dict[str, Any]]:
    """Add this attempt of ``job`` (``restart_count``, resumed ``from_step``) to the record
    and return ``job``'s attempts (a run resubmitted with its run.id is another job); an
    attempt torchrun restarted in its allocation replaces its entry. A record that cannot
    be written is left as it was (the count is then this attempt's alone). Outside a
    requeueable job (``job`` None) each start adds an entry."""
    attempts = read_records(run_dir / RECORD, "from_step")
    entry = {"job": job, "restart_count": restart_count, "from_step": from_step, "pid": os.getpid()}
    last = attempts[-1] if attempts else {}
    # Outside a job (job None) every start is an attempt of its own.
    if job is not None and (last.get("job"), last.get("restart_count")) == (job, restart_count):
        attempts[-1] = entry
    else:
        attempts.append(entry)
    try:
        write_records(run_dir / RECORD, attempts)
    except OSError:
        return [entry]
    return [attempt for attempt in attempts if attempt.get("job") == job]


def attempts_without_progress(attempts: Sequence[Mapping[str, Any]]) -> int:
    """How many attempts in a row before the last one ended where they began (the next one
    resumed from the same step)."""
    steps = [int(attempt["from_step"]) for attempt in attempts]
    count = 0
    for earlier, later in zip(reversed(steps[:-1]), reversed(steps[1:]), strict=True):
        if later > earlier:
            break
        count += 1
    return count


def no_progress_refusal(attempts: Sequence[Mapping[str, Any]], limit: int) -> HpcDdpError | None:
    """The end of a job whose last ``limit`` attempts made no progress, or None."""
    stalled = attempts_without_progress(attempts)
    if limit == 0 or stalled < limit:
        return None
    step = attempts[-1]["from_step"]
    return HpcDdpError(
        f"the last {stalled} attempts of this job ended without moving the checkpoint past step "
        f"{step} (preempt.max_attempts_without_progress={limit}): not training again",
        "see why in the job's log (each attempt's last lines: preempted or killed before its "
        "first save?); checkpoint more often (checkpoint.every_steps) or raise "
        "preempt.max_attempts_without_progress (0: no limit), then submit with run.id=<this "
        "run's id> to continue",
        exit_code=EXIT_NO_PROGRESS,
    )


def read_attempts(run_dir: Path) -> list[dict[str, Any]]:
    """Every attempt of the run recorded so far, oldest first ([] without a record)."""
    return read_records(run_dir / RECORD, "from_step")


def end_attempt(
    run_dir: Path,
    job: str | None,
    restart_count: int,
    timeline: Mapping[str, float],
    times: AttemptTimes,
    ranks: int,
    status: str | None,
    last_step: int,
    from_step: int,
) -> dict[str, Any] | None:
    """Add to this attempt's entry how it ended (``status``: None for an agreed stop), the
    step it reached and where its time went; return the run's account over its attempts.
    An attempt that ended before its first step has no entry and adds none (None); a
    record that cannot be written is left as it was."""
    attempts = read_attempts(run_dir)
    this_attempt = {"job": job, "restart_count": restart_count, "pid": os.getpid()}
    if not attempts or any(attempts[-1].get(key) != value for key, value in this_attempt.items()):
        return None
    earlier = attempts[-2].get("last_step") if len(attempts) > 1 else None
    redone = redone_steps(earlier if isinstance(earlier, int) else None, from_step, last_step)
    end_unix = time.time()
    attempts[-1].update(
        status=(status or "stopped").lower(),
        start_unix=timeline.get("process_start_unix", timeline.get("entry_unix")),
        end_unix=end_unix,
        last_step=last_step,
        ranks=ranks,
        redone_steps=redone,
        account=attempt_account(timeline, end_unix, times, last_step - from_step, redone),
    )
    with contextlib.suppress(OSError):
        write_records(run_dir / RECORD, attempts)
    return run_account(attempts)
