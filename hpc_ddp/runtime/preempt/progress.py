"""The attempts of a run and the step each resumed from (``attempts.json`` in the run
directory, rank 0's): attempts that end without moving the checkpoint forward (preempted or
killed before their first save) are counted, and past
``preempt.max_attempts_without_progress`` in a row the job ends instead of training again.
Each attempt that ends with a chance to say so adds how it ended and where its time went
(:mod:`hpc_ddp.runtime.monitor.account`); one killed outright is settled by the next, from
its last logged interval. Standard library only."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.errors import EXIT_NO_PROGRESS, HpcDdpError
from hpc_ddp.runtime.monitor.account import (
    attempt_account,
    attempt_start_unix,
    is_number,
    redone_steps,
    run_account,
    unsplit_account,
)
from hpc_ddp.runtime.monitor.attempt_times import AttemptTimes
from hpc_ddp.runtime.safefiles import open_append, read_records, write_records
from hpc_ddp.runtime.tracking.record import last_logged

RECORD = "attempts.json"
#: Every rank's failures, one JSON line each: any rank appends to it.
FAILURES = "failures.jsonl"


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
    reading = times.reading()
    end_unix = time.time()  # after the reading: a pause between them falls in `other`
    attempts[index].update(
        status=(status or "stopped").lower(),
        start_unix=attempt_start_unix(timeline, end_unix),
        end_unix=end_unix,
        last_step=last_step,
        ranks=ranks,
        redone_steps=redone,
        account=attempt_account(timeline, end_unix, times, last_step - from_step, redone, reading),
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


def record_failure(run_dir: Path, where: Mapping[str, Any], failure: Mapping[str, Any]) -> None:
    """Add what ended a rank (``where``: its rank and host; ``failure``: the error, the step
    and when) to the run's failures, one line written at once, so the ranks' lines do not
    mix (appends are whole on a local or parallel file system; over NFS, ranks on different
    hosts may damage each other's line, which is then left out); a record that cannot be
    written is left out."""
    line = json.dumps({**where, **failure}, default=str) + "\n"
    with contextlib.suppress(OSError), open_append(run_dir / FAILURES) as record:
        record.write(line)


def read_failures(run_dir: Path) -> list[dict[str, Any]]:
    """Every failure recorded in ``run_dir``, by time ([] without a record; a damaged line
    is left out)."""
    try:
        lines = (run_dir / FAILURES).read_text().splitlines()
    except OSError:
        return []
    failures = []
    for line in lines:
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict) and is_number(entry.get("time")):
                failures.append(entry)
    return sorted(failures, key=lambda entry: float(entry["time"]))


#: How long after its attempt's recorded end a rank's own failure may come (the ranks' clocks
#: and ends differ by less); one later is a start that failed before its first step (which
#: keeps no attempt record). A lost contact may come later still (a lost node, a timeout).
FAILURE_AFTER_END_S = 10.0


def attempt_of(attempts: Sequence[Mapping[str, Any]], failure: Mapping[str, Any]) -> int | None:
    """The number (from 1) of the recorded attempt ``failure`` belongs to, or None: of the
    attempts of its job and restart (a rerun by hand is another job), the last one begun
    before it, unless that one had ended well before and the failure is a rank's own."""
    when, found = float(failure["time"]), None
    for number, attempt in enumerate(attempts, 1):
        same = all(
            attempt.get(key) == failure[key] for key in ("job", "restart_count") if key in failure
        )
        start = attempt.get("start_unix")
        if same and (not is_number(start) or float(start) <= when):
            found = number
    if found is None:
        return None
    ended = attempts[found - 1].get("end_unix")
    late = is_number(ended) and when > float(ended) + FAILURE_AFTER_END_S
    return None if late and not failure.get("follows_another_rank") else found


def failure_lines(
    attempts: Sequence[Mapping[str, Any]], failures: Sequence[Mapping[str, Any]]
) -> list[str]:
    """One line per attempt that failed (or start that failed before its first step, which
    keeps no attempt record), oldest first: the rank whose error came first (a rank that
    only lost contact with another comes after any that did not), where in the user's code,
    and how many ranks ended after it. Where every rank on record only lost contact, the
    ranks of the attempt with no line of their own come first: killed outright (SIGKILL,
    the out-of-memory killer) or with their host, they could not say so. ``failures``:
    :func:`read_failures`'s."""
    groups: dict[str, tuple[Mapping[str, Any], list[Mapping[str, Any]]]] = {}
    unrecorded_since: float | None = None
    for failure in failures:
        number = attempt_of(attempts, failure)
        if number is not None:
            label, attempt = f"attempt {number}", attempts[number - 1]
        else:  # the starts that failed: apart when a minute or more lies between
            if unrecorded_since is None or failure["time"] - unrecorded_since > 60.0:
                unrecorded_since = failure["time"]
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unrecorded_since))
            label, attempt = f"a start at {when}", {}
        groups.setdefault(label, (attempt, []))[1].append(failure)
    lines = []
    for label, (attempt, found) in groups.items():
        first = min(found, key=lambda f: (bool(f.get("follows_another_rank")), f["time"]))
        at = f", at {first['at']}" if first.get("at") else ""
        ranks = {str(f.get("rank")) for f in found}
        others = len(ranks - {str(first.get("rank"))})
        after = f"; {others} other rank(s) ended after it" if others else ""
        said = (
            f"rank {first.get('rank', '?')} on {first.get('host', '?')}: "
            f"{first.get('error', '?')}{at}{after}"
        )
        silent = (
            _silent_ranks(attempt.get("ranks"), ranks) if first.get("follows_another_rank") else []
        )
        if silent:
            which = ", ".join(silent[:8]) + (", ..." if len(silent) > 8 else "")
            said = (
                f"rank{'s' if len(silent) > 1 else ''} {which} left no line (killed outright: "
                "by SIGKILL, the out-of-memory killer or with its host; or stopped before it "
                f"could write; the job's log says which), then {said}"
            )
        lines.append(f"{label} failed at step {first.get('step', '?')}: {said}")
    return lines


def _silent_ranks(world_size: object, on_record: set[str]) -> list[str]:
    """The ranks of an attempt of ``world_size`` ranks with no failure ``on_record``."""
    if not isinstance(world_size, int):
        return []
    return [str(rank) for rank in range(world_size) if str(rank) not in on_record]
