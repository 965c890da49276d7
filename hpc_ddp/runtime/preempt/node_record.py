"""The run's record of failed hosts (``excluded_hosts.json`` in the run directory): each
node failure's hosts, why they failed, the attempt, and whether the job was requeued without
them. Standard library only: `hpc-ddp runs` reads it without torch."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: Where the run directory keeps each node failure: its hosts, why, and the attempt.
RECORD = "excluded_hosts.json"


def node_failures(run_dir: Path) -> list[dict[str, Any]]:
    """The node failures recorded in ``run_dir``, oldest first ([] when none or unreadable)."""
    try:
        failures = json.loads((run_dir / RECORD).read_text())
    except (OSError, ValueError):
        return []
    return failures if isinstance(failures, list) else []


def excluded_hosts(failures: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every host the failures left out, once each, in the order they failed."""
    return list(dict.fromkeys(host for failure in failures for host in failure["hosts"]))


def requeues_for_nodes(run_dir: Path) -> int:
    """How many of the job's requeues were for failed hosts (not counted by
    ``preempt.max_requeues``)."""
    return sum(1 for failure in node_failures(run_dir) if failure.get("requeued"))


def left_out_lines(failures: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per node failure: the attempt, and why each host was left out."""
    return [
        f"attempt {failure.get('restart_count', '?')}: left out "
        f"{', '.join(failure['hosts'])}: {'; '.join(failure.get('why', [])) or 'no reason kept'}"
        + ("" if failure.get("requeued") else " (not requeued)")
        for failure in failures
    ]
