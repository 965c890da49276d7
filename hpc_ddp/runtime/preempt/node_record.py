"""The run's record of failed hosts (``excluded_hosts.json`` in the run directory): each
node failure's job, hosts, why they failed, the attempt, and whether the job was requeued
without them. Standard library only: `hpc-ddp runs` reads it without torch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.safefiles import read_records

#: Where the run directory keeps each node failure: its hosts, why, and the attempt.
RECORD = "excluded_hosts.json"


def node_failures(run_dir: Path) -> list[dict[str, Any]]:
    """The node failures recorded in ``run_dir``, oldest first ([] when none or unreadable;
    an entry that is not a record of hosts is left out)."""
    failures = read_records(run_dir / RECORD, "hosts")
    return [failure for failure in failures if isinstance(failure["hosts"], list)]


def of_job(failures: Sequence[Mapping[str, Any]], job: str | None) -> list[Mapping[str, Any]]:
    """The failures of ``job`` (a run resubmitted with its run.id starts a budget anew)."""
    return [failure for failure in failures if failure.get("job") == job]


def excluded_hosts(failures: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every host left out of a job (its failure requeued the job without it), once each, in
    the order they failed."""
    return list(
        dict.fromkeys(
            str(host)
            for failure in failures
            if failure.get("requeued")
            for host in failure["hosts"]
        )
    )


def requeues_for_nodes(run_dir: Path, job: str | None) -> int:
    """How many of ``job``'s requeues left failed hosts out (not counted by
    ``preempt.max_requeues``)."""
    return sum(1 for failure in of_job(node_failures(run_dir), job) if failure.get("requeued"))


def left_out_lines(failures: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per node failure: the job and attempt, the hosts, why, and what was done."""
    return [
        f"job {failure.get('job', '?')} attempt {failure.get('restart_count', '?')}: "
        f"{', '.join(map(str, failure['hosts']))} {failure.get('event', 'failed the checks')} "
        f"({'; '.join(failure.get('why', [])) or 'no reason kept'}): "
        + ("left out, the job requeued" if failure.get("requeued") else "not left out")
        for failure in failures
    ]
