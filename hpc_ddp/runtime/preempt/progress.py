"""The attempts of a run and the step each resumed from (``attempts.json`` in the run
directory, rank 0's): attempts that end without moving the checkpoint forward (preempted or
killed before their first save) are counted, and past
``preempt.max_attempts_without_progress`` in a row the job ends instead of training again.
Each attempt that ends with a chance to say so adds how it ended and where its time went
(:mod:`hpc_ddp.runtime.monitor.account`); one killed outright is settled by the next, from
its last logged interval. Standard library only."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.errors import EXIT_NO_PROGRESS, HpcDdpError
from hpc_ddp.runtime.monitor.account import (
    AttemptTimes,
    attempt_account,
    is_number,
    redone_steps,
    run_account,
    unsplit_account,
)
from hpc_ddp.runtime.safefiles import read_records, write_records
from hpc_ddp.runtime.tracking.record import last_logged

RECORD = "attempts.json"


def record_attempt(
    run_dir: Path,
    job: str | None,
    restart_count: int,
    from_step: int,
    attempt_id: str | None = None,
    start_unix: float | None = None,
    ranks: int | None = None,
) -> list[dict[str, Any]]:
    """Add this attempt of ``job`` (``restart_count``, resumed ``from_step``; ``attempt_id``
    names its entry for :func:`end_attempt`; ``start_unix`` and ``ranks`` let the next
    attempt charge it if it is killed outright) to the record and return ``job``'s
    attempts (a run resubmitted with its run.id is another job), an attempt torchrun
    restarted in its allocation counted once: the last of its entries. The attempt before
    it, if it ended without a word, is settled first (:func:`settle_killed`). A record that
    cannot be written is left as it was (the count is then this attempt's alone)."""
    attempts = read_records(run_dir / RECORD, "from_step")
    settle_killed(attempts, run_dir, time.time() if start_unix is None else start_unix)
    entry: dict[str, Any] = {"job": job, "restart_count": restart_count, "from_step": from_step}
    if attempt_id:
        entry["attempt"] = attempt_id
    if start_unix is not None and ranks is not None:
        entry.update(start_unix=start_unix, ranks=ranks)
    attempts.append(entry)
    try:
        write_records(run_dir / RECORD, attempts)
    except OSError:
        return [entry]
    of_job = [attempt for attempt in attempts if attempt.get("job") == job]
    return [
        attempt
        for attempt, later in zip(of_job, [*of_job[1:], {}], strict=True)
        if attempt.get("restart_count") != later.get("restart_count")
    ]


def settle_killed(attempts: list[dict[str, Any]], run_dir: Path, now_start: float) -> None:
    """Give the last attempt an account if it ended without writing one (killed outright):
    from its start to its last interval logged before this attempt (started ``now_start``)
    began, the step it logged there, and the steps it took again. One that logged nothing,
    or does not say when it started, is only marked killed: nothing to charge it from."""
    if not attempts or "status" in attempts[-1]:
        return
    killed = attempts[-1]
    killed["status"] = "killed"
    started, from_step = killed.get("start_unix"), killed.get("from_step")
    if not is_number(started) or not isinstance(from_step, int):
        return
    logged = last_logged(run_dir, float(started), now_start)
    if logged is None:
        return
    end_unix, last_step = logged
    earlier = attempts[-2].get("last_step") if len(attempts) > 1 else None
    killed.update(
        end_unix=end_unix,
        last_step=last_step,
        redone_steps=redone_steps(
            earlier if isinstance(earlier, int) else None, from_step, last_step
        ),
        account=unsplit_account(end_unix - float(started)),
    )


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
    attempt_id: str,
    timeline: Mapping[str, float],
    times: AttemptTimes,
    ranks: int,
    status: str | None,
    last_step: int,
    from_step: int,
) -> dict[str, Any] | None:
    """Add to this attempt's entry (the one :func:`record_attempt` wrote under
    ``attempt_id``) how it ended (``status``: None for an agreed stop), the step it reached
    and where its time went; return the run's account over its attempts. An attempt that
    ended before its first step has no entry and adds none (None); a record that cannot be
    written is left as it was."""
    attempts = read_attempts(run_dir)
    found = [
        index for index, attempt in enumerate(attempts) if attempt.get("attempt") == attempt_id
    ]
    if not found:
        return None
    index = found[-1]
    earlier = attempts[index - 1].get("last_step") if index > 0 else None
    redone = redone_steps(earlier if isinstance(earlier, int) else None, from_step, last_step)
    end_unix = time.time()
    attempts[index].update(
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


def forget_attempt(run_dir: Path, attempt_id: str) -> None:
    """Take this attempt's entry out again: it found the run finished and did nothing."""
    attempts = read_attempts(run_dir)
    kept = [attempt for attempt in attempts if attempt.get("attempt") != attempt_id]
    if len(kept) != len(attempts):
        with contextlib.suppress(OSError):
            write_records(run_dir / RECORD, kept)
