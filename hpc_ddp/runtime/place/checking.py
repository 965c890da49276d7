"""The checks before the first step, on every rank at once (see :mod:`.health`): each rank
runs its own, the findings are gathered, rank 0 says what they cost and records them in the
run directory (checks.json); a failure is answered by the caller (a requeue without the failed
hosts, or one line per host)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hpc_ddp.runtime.config import ChecksConfig
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.place.dist import all_gather_object, broadcast_object
from hpc_ddp.runtime.place.health import (
    Finding,
    allreduce_gbps,
    bandwidth_findings,
    collective_findings,
    command_findings,
    device_findings,
    storage_findings,
    timed,
)
from hpc_ddp.runtime.place.plan import LaunchPlan
from hpc_ddp.runtime.safefiles import replace_bytes

#: Where the run directory keeps the last attempt's checks.
RECORD = "checks.json"


@dataclass(frozen=True)
class RankChecks:
    """What one rank found (nothing: it passed) and what each of its checks took."""

    rank: int
    host: str
    findings: tuple[Finding, ...] = ()
    seconds: dict[str, float] = field(default_factory=dict)


def own_checks(
    plan: LaunchPlan,
    settings: ChecksConfig,
    environ: Mapping[str, str],
    collective: bool,
    shared_run_dir: bool = True,
) -> RankChecks:
    """This rank's checks: its devices; checks.command once per node (local rank 0), and the
    run directory there too (``shared_run_dir``: every node writes it, as with checkpoints;
    else rank 0 only); with ``collective`` (a process group is up), the collective path."""
    env, seconds = plan.dist_env, dict[str, float]()
    findings = timed(seconds, "devices", device_findings, plan.device.devices,
                     settings.min_free_gpu_memory)  # fmt: skip
    if env.local_rank == 0 and (shared_run_dir or env.is_main):
        findings += timed(seconds, "storage", storage_findings, plan.run_dir, env.rank)
    if env.local_rank == 0 and settings.command:
        findings += timed(seconds, "command", command_findings, settings.command,
                          settings.timeout_s, environ)  # fmt: skip
    if collective and env.world_size > 1:
        device = torch.device(plan.device.device)
        findings += timed(seconds, "collective", collective_findings, env.rank, env.world_size,
                          device)  # fmt: skip
    # Slurm's name for the node, which --exclude takes, where it differs from the hostname.
    host = environ.get("SLURMD_NODENAME") or env.hostname
    return RankChecks(env.rank, host, tuple(findings), seconds)


def measured_gbps(plan: LaunchPlan, every: Sequence[RankChecks], group: Any | None) -> float | None:
    """The collective path's bandwidth, timed by every rank once all passed the collective
    check (they all know so from the gather), rank 0's figure for all."""
    if plan.dist_env.world_size == 1:
        return None
    if any(f.check == "collective" for checks in every for f in checks.findings):
        return None
    gbps = allreduce_gbps(plan.dist_env.world_size, torch.device(plan.device.device))
    return float(broadcast_object(gbps, group))


def failure_lines(every: Sequence[RankChecks]) -> list[str]:
    """One line per host that failed a check: its ranks, and each finding once."""
    hosts: dict[str, tuple[list[int], list[str]]] = {}
    for checks in every:
        if not checks.findings:
            continue
        ranks, lines = hosts.setdefault(checks.host, ([], []))
        ranks.append(checks.rank)
        lines += [line for line in map(Finding.line, checks.findings) if line not in lines]
    return [
        f"{host} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}): "
        + "; ".join(lines)
        for host, (ranks, lines) in hosts.items()
    ]


def cost_line(every: Sequence[RankChecks], gbps: float | None) -> str:
    """What the checks cost, the slowest rank's seconds per check."""
    slowest: dict[str, float] = {}
    for checks in every:
        for name, seconds in checks.seconds.items():
            slowest[name] = max(slowest.get(name, 0.0), seconds)
    parts = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in slowest.items())
    measured = f"; all-reduce {gbps:.1f} GB/s" if gbps is not None else ""
    hosts = len({checks.host for checks in every})
    return f"{len(every)} rank(s) on {hosts} host(s): {parts}{measured}"


def check_before_training(
    plan: LaunchPlan,
    settings: ChecksConfig,
    environ: Mapping[str, str],
    control_group: Any | None,
    shared_run_dir: bool = True,
) -> dict[str, Any]:
    """Every rank's checks, gathered on every rank (a collective); rank 0 says their cost. The
    record says the same on every rank: ``failures`` (one line per failed host, and the
    bandwidth floor: rank 0's timing), the failed ``hosts``, every rank's results. A failure
    is recorded in the run directory at once (see :func:`checks_refusal`); what passed is
    recorded by :func:`record_checks` once the run knows it will train (a finished run
    started again is left as it was)."""
    own = own_checks(plan, settings, environ, True, shared_run_dir)
    every = all_gather_object(own, control_group)
    floor = settings.min_allreduce_gbps
    gbps = measured_gbps(plan, every, control_group) if floor is not None else None
    lines = failure_lines(every)
    hosts = [line.split(" ", 1)[0] for line in lines]
    if gbps is not None and floor is not None:
        lines += [f"all ranks: {finding.line()}" for finding in bandwidth_findings(gbps, floor)]
    record = {"passed": not lines, "failures": lines, "hosts": hosts, "allreduce_gbps": gbps,
              "ranks": [asdict(checks) for checks in every]}  # fmt: skip
    if plan.dist_env.is_main:
        if lines:
            record_checks(plan.run_dir, record)
        else:
            get_logger().info(f"checks passed: {cost_line(every, gbps)}")
    return record


def checks_refusal(record: Mapping[str, Any], run_dir: Path) -> HpcDdpError:
    """The refusal of failed checks: one line per failed host, the hosts to leave out."""
    hosts, lines = record["hosts"], record["failures"]
    where = f"{len(hosts)} host(s)" if hosts else "the collective path"
    return HpcDdpError(
        f"checks before the first step failed on {where}:\n  " + "\n  ".join(lines),
        (f"leave the host(s) out: sbatch --exclude={','.join(sorted(hosts))} (and tell "
         "the admins); " if hosts else "")
        + f"{run_dir / RECORD} has every rank's results; checks.enabled=false skips the checks",
    )  # fmt: skip


def record_checks(run_dir: Path, record: Mapping[str, Any]) -> None:
    """The attempt's checks in ``run_dir/checks.json`` (rank 0's to write)."""
    replace_bytes(run_dir / RECORD, (json.dumps(record, indent=1) + "\n").encode())
