"""`hpc-ddp runs`: the runs under an output directory, from the files each run keeps."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.monitor.account import account_line, is_account, run_account
from hpc_ddp.runtime.monitor.paces import PACE_METRICS
from hpc_ddp.runtime.monitor.throughput import THROUGHPUT_METRICS
from hpc_ddp.runtime.preempt.node_record import left_out_lines, node_failures
from hpc_ddp.runtime.preempt.progress import failure_lines, read_attempts, read_failures
from hpc_ddp.runtime.safefiles import read_records
from hpc_ddp.runtime.tracking.record import (
    PROVENANCE_FILE,
    STATUS_FILE,
    pid_alive,
    read_metrics,
    read_status,
)
from hpc_ddp.view.steptime import steps_split_line

#: The machines' metrics (each host's CPU and memory, each GPU's), not the model's.
SYSTEM_PREFIX = "system/"
#: Interval metrics that describe speed, not the model.
NOT_CURVES = {
    "samples_per_s", "steps_per_s", "lr", "goodput_percent", "rank_hours", *PACE_METRICS,
    *THROUGHPUT_METRICS,
}  # fmt: skip


@dataclass(frozen=True)
class RunView:
    """One run as its files show it."""

    path: Path
    name: str
    run_id: str
    #: running, requeued, finished, failed, stopped; "lost" when it claims to run on this
    #: host under a pid that is gone (killed without a chance to say so).
    state: str
    global_step: int
    epoch: int
    attempts: int
    updated: float
    #: The newest value of each training metric (interval or epoch).
    train: dict[str, float | None] = field(default_factory=dict)
    #: The newest value of each validation metric (names starting with "val").
    val: dict[str, float | None] = field(default_factory=dict)
    #: Hosts that failed the checks and were left out of the job, one line per failure.
    left_out: tuple[str, ...] = ()
    #: Each attempt's code and environment, one line each (provenance.json).
    code: tuple[str, ...] = ()
    #: Where each attempt's time went, one line each, and the run's (attempts.json).
    time: tuple[str, ...] = ()
    #: What ended each attempt that failed, one line each (failures.jsonl).
    failures: tuple[str, ...] = ()
    #: The productive steps' share of every attempt's allocation (%); None: no account.
    goodput: float | None = None


#: The names a held-out split's metrics go by (``val_loss``, ``eval/accuracy``,
#: ``test_loss`` as pytorch/examples' scripts name theirs).
HELD_OUT = ("val", "valid", "validation", "eval", "test")


def is_validation(name: str) -> bool:
    """A metric of a held-out split: named ``<split>_...``, ``<split>/...`` or ``<split>``
    for a split in :data:`HELD_OUT`."""
    base = name.removeprefix("interval/")
    split = base.replace("/", "_").split("_", 1)[0]
    return split in HELD_OUT


def metric_kind(name: str) -> str | None:
    """'train', 'val' or None (speed and learning rate are not curves)."""
    base = name.removeprefix("interval/")
    if base in NOT_CURVES or name.startswith(SYSTEM_PREFIX):
        return None
    return "val" if is_validation(name) else "train"


def _state(status: dict[str, Any]) -> str:
    state = str(status.get("state", "unknown"))
    same_host = status.get("host") == socket.gethostname()
    pid = status.get("pid")
    pid = pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else -1
    if state == "running" and same_host and not pid_alive(pid):
        return "lost"
    return state


def _count(status: dict[str, Any], key: str, default: int, path: Path) -> int:
    value = status.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise HpcDdpError(
            f"{path / STATUS_FILE}: {key}={value!r} is not a count: the record is damaged",
            "the run's checkpoints are not affected; remove or repair that file",
        )
    return value


def load_run(path: Path) -> RunView | None:
    """The run in ``path`` (a run directory), or None if it is not one; HpcDdpError for a
    damaged status.json."""
    status = read_status(path)
    if status is None:
        return None
    attempts = read_attempts(path)
    accounted = any(is_account(attempt.get("account")) for attempt in attempts)
    updated = status.get("updated", 0.0)
    train: dict[str, float | None] = {}
    val: dict[str, float | None] = {}
    for entry in read_metrics(path):
        for name, value in entry["metrics"].items():
            kind = metric_kind(name)
            if kind is not None:
                (val if kind == "val" else train)[name.removeprefix("interval/")] = value
    return RunView(
        path=path,
        name=path.parent.name,
        run_id=path.name,
        state=_state(status),
        global_step=_count(status, "global_step", 0, path),
        epoch=_count(status, "epoch", 0, path),
        attempts=_count(status, "attempts", 1, path),
        updated=float(updated) if isinstance(updated, int | float) else 0.0,
        train=train,
        val=val,
        left_out=tuple(left_out_lines(node_failures(path))),
        code=tuple(code_lines(read_records(path / PROVENANCE_FILE, "python"))),
        time=tuple(time_lines(attempts, _state(status) == "running")),
        failures=tuple(failure_lines(attempts, read_failures(path))),
        goodput=run_account(attempts)["goodput_percent"] if accounted else None,
    )


def _short(value: Any) -> str:
    return str(value)[:12] if value else "none"


def code_line(number: int, attempt: dict[str, Any]) -> str:
    """An attempt's code and environment: when, the script and its sha256, the commit (and
    its uncommitted changes), the versions."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(attempt.get("at_unix", 0)))
    job = f", job {attempt['job']}" if attempt.get("job") else ""
    commit = _short(attempt.get("git_commit"))
    if attempt.get("git_dirty"):
        commit += f" + uncommitted {_short(attempt.get('git_diff_sha256'))}"
    script = Path(str(attempt.get("script"))).name
    return (
        f"attempt {number} ({when}{job}): {script} sha256 {_short(attempt.get('script_sha256'))}"
        f", commit {commit}, python {attempt.get('python')}, torch {attempt.get('torch')}, "
        f"{len(attempt.get('packages', []))} packages"
    )


def code_lines(attempts: Iterable[dict[str, Any]]) -> list[str]:
    """One :func:`code_line` per attempt, oldest first."""
    return [code_line(number, attempt) for number, attempt in enumerate(attempts, 1)]


def time_lines(attempts: list[dict[str, Any]], running: bool) -> list[str]:
    """Where each attempt's time went, then the run's over all of them (``running``: the
    last attempt has not ended); [] without an account (none kept, or a record from before
    accounts were kept)."""
    if not any(is_account(attempt.get("account")) for attempt in attempts):
        return []
    lines = []
    for number, attempt in enumerate(attempts, 1):
        account = attempt.get("account")
        if is_account(account) and attempt.get("status") == "killed":
            said = (
                f"killed, last logged at step {attempt.get('last_step')}): "
                f"{float(account['allocation_s']):.1f} s to then, not split"
            )
        elif is_account(account):
            said = f"{attempt.get('status')} at step {attempt.get('last_step')}): "
            said += account_line(account)
        elif running and number == len(attempts):
            said = "running)"
        else:
            said = "ended unseen): no account, killed before it could write one"
        lines.append(f"attempt {number} ({said}")
    total = run_account(attempts)
    lines.append(
        f"all attempts: {account_line(total)}, {total['rank_hours']:.3g} rank-hours, "
        f"{total['queued_s']:.0f} s queued between attempts"
    )
    return lines


def format_run(run: RunView, now: float | None = None) -> str:
    """`hpc-ddp runs NAME/ID`: the run's line, its failed hosts, each attempt's code, where
    each attempt's time went, where the steps' time went and what ended the attempts that
    failed."""
    split = steps_split_line(run.path)
    lines = (*run.code, *run.time, *([split] if split else []), *run.failures)
    return "\n".join([format_runs([run], now), *(f"  {line}" for line in lines)])


def find_runs(output_dir: Path, damaged: list[str] | None = None) -> list[RunView]:
    """Every run under ``output_dir`` (``<name>/<run id>/status.json``), newest first; a run
    whose record is damaged is left out, with one line about it added to ``damaged``."""
    if not output_dir.is_dir():
        raise HpcDdpError(
            f"no such directory: {output_dir}",
            "pass the run.output_dir your runs write to (default: runs)",
        )
    runs = []
    for status in output_dir.glob(f"*/*/{STATUS_FILE}"):
        try:
            runs.append(load_run(status.parent))
        except HpcDdpError as error:
            if damaged is not None:
                damaged.append(error.message)
    return sorted((run for run in runs if run), key=lambda run: run.updated, reverse=True)


def find_run(spec: str, output_dir: Path) -> RunView:
    """A run given as its directory, ``name/id`` or ``id`` under ``output_dir``."""
    direct = Path(spec)
    if (direct / STATUS_FILE).is_file():
        run = load_run(direct)
        assert run is not None
        return run
    every = find_runs(output_dir) if output_dir.is_dir() else []
    matches = [run for run in every if spec in (run.run_id, f"{run.name}/{run.run_id}")]
    if len(matches) == 1:
        return matches[0]
    named = [f"{run.name}/{run.run_id}" for run in every if run.name == spec]
    if not matches and named:
        raise HpcDdpError(
            f"{spec!r} is a run name with {len(named)} run(s) in {output_dir}, newest first: "
            + ", ".join(named[:5])
            + (", ..." if len(named) > 5 else ""),
            f"give one as NAME/ID, e.g. {named[0]} (the newest)",
        )
    if not matches:
        if (direct / "sweep.json").is_file():  # the sweep's record, sweep/manifest.py
            raise HpcDdpError(
                f"{spec} is a sweep's folder, not a run's",
                f"hpc-ddp sweep plot {spec} draws its tasks; hpc-ddp plot {spec}/task-000 "
                "one task's run",
            )
        raise HpcDdpError(
            f"no run {spec!r} in {output_dir}",
            "give a run directory, or NAME/ID or ID as `hpc-ddp runs` lists them",
        )
    names = ", ".join(f"{run.name}/{run.run_id}" for run in matches)
    raise HpcDdpError(f"{spec!r} names {len(matches)} runs: {names}", "give NAME/ID")


def _values(metrics: dict[str, float | None], limit: int = 3) -> str:
    shown = [
        f"{name}={value:.4g}" if value is not None else f"{name}=nan"
        for name, value in list(metrics.items())[:limit]
    ]
    return " ".join(shown) or "-"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h ago"
    return f"{seconds / 86400:.0f}d ago"


def format_runs(runs: Iterable[RunView], now: float | None = None) -> str:
    """A table, one run per line; then the hosts each run left out, and why."""
    runs, now = list(runs), time.time() if now is None else now
    header = ("RUN", "STATE", "STEP", "EPOCH", "ATTEMPTS", "GOODPUT", "UPDATED", "TRAIN", "VAL")
    rows = [
        (
            f"{run.name}/{run.run_id}",
            run.state,
            str(run.global_step),
            str(run.epoch),
            str(run.attempts),
            "-" if run.goodput is None else f"{run.goodput:.0f}%",
            _age(max(0.0, now - run.updated)),
            _values(run.train),
            _values(run.val),
        )
        for run in runs
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for row in [header, *rows]:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    for run in runs:
        lines += [f"{run.name}/{run.run_id}: {line}" for line in run.left_out]
    return "\n".join(lines)
