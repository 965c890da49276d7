"""A host that failed the checks is left out of the job's next attempt: rank 0 records it in
the run directory (``excluded_hosts.json``), adds it to the job's ``ExcNodeList`` and requeues,
within ``preempt.max_node_failures`` (a budget of its own, apart from
``preempt.max_requeues``); past it the job ends with :data:`EXIT_NODES_FAILED`. Only hosts
that failed a check of their own (devices, the site's command) and not every host of the job
are left out: a shared file system or the collective path is no one host's fault."""

from __future__ import annotations

import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from hpc_ddp.runtime.config import PreemptConfig
from hpc_ddp.runtime.errors import EXIT_NODES_FAILED, HpcDdpError, Stopped
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.place.checking import checks_refusal
from hpc_ddp.runtime.place.dist import broadcast_object
from hpc_ddp.runtime.place.plan import LaunchPlan
from hpc_ddp.runtime.place.slurm import (
    ask_slurm,
    job_allows_requeue,
    job_field,
    queue_job_id,
    show_job,
)
from hpc_ddp.runtime.preempt.node_record import RECORD, excluded_hosts, node_failures, of_job
from hpc_ddp.runtime.preempt.signals import StopSignals
from hpc_ddp.runtime.safefiles import write_records

#: Checks whose failure is not one host's: the run directory (shared), the collective path.
SHARED_CHECKS = frozenset({"storage", "collective", "collective bandwidth"})


def hosts_to_leave_out(record: Mapping[str, Any]) -> list[str]:
    """The hosts a check of their own failed on ([] when none, or when every host of the
    job did: then the fault is not in the hosts)."""
    ranks = record["ranks"]
    failed = [
        str(checks["host"])
        for checks in ranks
        if any(finding["check"] not in SHARED_CHECKS for finding in checks["findings"])
    ]
    hosts = list(dict.fromkeys(failed))
    return hosts if len(hosts) < len({checks["host"] for checks in ranks}) else []


def with_hosts(excluded: str, hosts: Sequence[str]) -> str:
    """An ExcNodeList value: the job's own exclusions (Slurm's "(null)": none) and ``hosts``."""
    kept = [] if excluded in ("", "(null)") else [excluded]
    return ",".join([*kept, *hosts])


def _scontrol(*words: str, timeout_s: float) -> str | None:
    """Run scontrol; None when it worked, else what went wrong."""
    return ask_slurm(["scontrol", *words], timeout_s).failure


def requeue_without(
    job: str, hosts: Sequence[str], timeout_s: float, delay_s: float = 0.0
) -> str | None:
    """Requeue ``job`` held, add ``hosts`` to its ExcNodeList (Slurm changes it only while the
    job waits) and, with ``delay_s``, its begin time, then release it; None when done, else
    what failed. Once held, the job is always released, so no failure leaves it waiting."""
    excluded = job_field(show_job(job, timeout_s), "ExcNodeList")
    if excluded is None:
        return f"scontrol show job {job} did not answer: its own exclusions are unknown"
    later = [f"StartTime=now+{round(delay_s)}"] if delay_s >= 1 else []
    # Slurm sends the step SIGTERM as the requeue ends it: the scontrol processes started
    # from here on inherit SIG_IGN and finish.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    failed = _scontrol("requeuehold", job, timeout_s=timeout_s)
    if failed is not None:
        return f"scontrol requeuehold {job}: {failed}"
    update = ("update", f"JobId={job}", f"ExcNodeList={with_hosts(excluded, hosts)}", *later)
    failed = _scontrol(*update, timeout_s=timeout_s)
    released = _scontrol("release", job, timeout_s=timeout_s)
    if released is not None:
        get_logger().error(f"job {job} stays held: scontrol release failed: {released}; run "
                           f"`scontrol release {job}`")  # fmt: skip
    return None if failed is None else f"scontrol {' '.join(update)}: {failed} (requeued as it was)"


def leave_out(
    hosts: Sequence[str],
    why: Sequence[str],
    run_dir: Path,
    environ: Mapping[str, str],
    config: PreemptConfig,
    event: str = "failed the checks",
) -> tuple[str, str]:
    """Rank 0, or the batch script after a lost rank (``event`` says which): record the
    failed ``hosts`` and requeue the job without them, within the budget. Returns (outcome,
    line): "requeued", "exhausted", or "refused" (not requeued: the failure's own ending
    stands)."""
    job = queue_job_id(environ)
    if job is None or not config.requeue:
        return "refused", ""
    failures = node_failures(run_dir)
    failure = {"job": job, "hosts": list(hosts), "event": event, "why": list(why),
               "at_unix": round(time.time(), 3),
               "restart_count": int(environ.get("SLURM_RESTART_COUNT", "0") or 0),
               "requeued": False}  # fmt: skip
    try:
        write_records(run_dir / RECORD, [*failures, failure])
    except OSError as error:
        return "refused", f"not requeueing: {run_dir / RECORD} cannot be written: {error}"
    earlier = [earlier for earlier in of_job(failures, job) if earlier.get("requeued")]
    if len(earlier) >= config.max_node_failures:
        left_out = excluded_hosts(earlier)
        return "exhausted", (
            f"node failures of job {job}: {len(earlier) + 1}, more than "
            f"preempt.max_node_failures={config.max_node_failures}: not requeueing again; "
            f"left out before: {', '.join(left_out) or 'none'}; failed now: {', '.join(hosts)}"
        )
    if not job_allows_requeue(job, config.requeue_timeout_s):
        return "refused", f"not requeueing: job {job} does not allow requeue (sbatch --requeue)"
    failed = requeue_without(job, hosts, config.requeue_timeout_s, config.requeue_delay_s)
    if failed is not None:
        return "refused", f"could not requeue without {', '.join(hosts)}: {failed}"
    failure["requeued"] = True
    try:
        write_records(run_dir / RECORD, [*failures, failure])
    except OSError as error:
        get_logger().warning(f"{run_dir / RECORD} cannot be written: {error}")
    every = ", ".join(excluded_hosts([*earlier, failure]))
    return "requeued", (
        f"left {', '.join(hosts)} out of job {job} (ExcNodeList: {every}) and requeued it "
        f"(node failure {len(earlier) + 1} of preempt.max_node_failures="
        f"{config.max_node_failures}); {run_dir / RECORD} says why"
    )


def answer_failed_checks(
    record: Mapping[str, Any],
    plan: LaunchPlan,
    config: PreemptConfig,
    environ: Mapping[str, str],
    group: Any | None,
    signals: StopSignals,
) -> NoReturn:
    """Failed checks, on every rank: in a Slurm job that allows it, the hosts that failed a
    check of their own are left out and the job requeued (every rank ends with 0); past the
    budget the job ends with EXIT_NODES_FAILED; else the checks' refusal (one line per
    host). Every rank decides alike from the record and the environment."""
    refusal = checks_refusal(record, plan.run_dir)
    hosts = hosts_to_leave_out(record)
    if not (hosts and queue_job_id(environ) and config.requeue):
        raise refusal
    # The requeue's SIGTERM must not cut the ranks' exit short: the handlers from before the
    # start come back first, so the start's own restore on the way out changes nothing.
    signals.restore()
    signals.ignore_from_now_on()
    answer = ("refused", "")
    if plan.dist_env.is_main:
        get_logger().warning(refusal.message)
        answer = leave_out(hosts, record["failures"], plan.run_dir, environ, config)
    outcome, line = broadcast_object(answer, group)
    if outcome == "requeued":
        if plan.dist_env.is_main:
            get_logger().info(line)
        raise Stopped(0, True, plan.run_dir.name)
    if outcome == "exhausted":
        raise HpcDdpError(
            line,
            "have the hosts repaired (tell the admins), or raise preempt.max_node_failures; "
            f"{plan.run_dir / RECORD} lists each failure",
            exit_code=EXIT_NODES_FAILED,
        )
    if plan.dist_env.is_main and line:
        get_logger().warning(line)
    raise refusal
