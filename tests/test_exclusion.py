"""Failed hosts left out of the job, in this process (no Slurm: the paths that need scontrol
run on the real test cluster, test_slurm_e2e.py): the record, the ExcNodeList value, the
budget of node failures apart from max_requeues, its exit code, and `hpc-ddp runs`."""

from __future__ import annotations

import dataclasses
import io
import json
import signal
from collections.abc import Iterator
from contextlib import nullcontext, redirect_stderr
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.runtime.config import PreemptConfig, RunConfig, RuntimeConfig
from hpc_ddp.runtime.errors import EXIT_NO_PROGRESS, EXIT_NODES_FAILED, HpcDdpError
from hpc_ddp.runtime.exits import report_failure
from hpc_ddp.runtime.loop.checkpointer import Checkpointer
from hpc_ddp.runtime.loop.context import RunContext
from hpc_ddp.runtime.loop.intervals import MetricLog
from hpc_ddp.runtime.loop.position import Position
from hpc_ddp.runtime.loop.stopper import Stopper
from hpc_ddp.runtime.loop.streams import StreamStates
from hpc_ddp.runtime.preempt.exclusion import (
    answer_failed_checks,
    hosts_to_leave_out,
    leave_out,
    with_hosts,
)
from hpc_ddp.runtime.preempt.node_record import (
    RECORD,
    excluded_hosts,
    left_out_lines,
    node_failures,
    of_job,
    requeues_for_nodes,
)
from hpc_ddp.runtime.preempt.progress import (
    attempts_without_progress,
    no_progress_refusal,
    record_attempt,
)
from hpc_ddp.runtime.preempt.signals import StopSignals
from hpc_ddp.runtime.session.joining import resolve_launch
from hpc_ddp.runtime.tracking.base import NullTracker
from hpc_ddp.view.runs import RunView, format_runs


@pytest.fixture(autouse=True)
def stop_handlers_kept() -> Iterator[None]:
    """A refused start ignores the stop signals from then on (its process is ending): this
    process's own handlers come back after each test."""
    kept = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for signum, handler in kept.items():
        signal.signal(signum, handler)


EARLIER = {"job": "7", "hosts": ["node5"], "why": ["node5 (rank 3): devices: NaN"],
           "restart_count": 0, "requeued": True}  # fmt: skip
FAILED = ["node2 (rank 1): checks.command: `health` exited with 1: ECC errors"]


def test_the_jobs_own_exclusions_are_kept() -> None:
    assert with_hosts("(null)", ["node2"]) == "node2"
    assert with_hosts("", ["node2", "node3"]) == "node2,node3"
    assert with_hosts("gpu[01-02]", ["node2"]) == "gpu[01-02],node2"


def ranks(*hosts_and_checks: tuple[str, list[str]]) -> dict[str, Any]:
    """A checks record of one rank per (host, failed checks)."""
    return {"ranks": [
        {"rank": rank, "host": host, "findings": [{"check": c, "seen": "", "expected": ""}
                                                  for c in checks]}
        for rank, (host, checks) in enumerate(hosts_and_checks)
    ]}  # fmt: skip


def test_only_hosts_that_failed_a_check_of_their_own_are_left_out() -> None:
    record = ranks(("node1", []), ("node2", ["checks.command"]), ("node3", ["gpu cuda:0"]))
    assert hosts_to_leave_out(record) == ["node2", "node3"]
    shared = ranks(("node1", []), ("node2", ["storage", "collective"]))
    assert hosts_to_leave_out(shared) == [], "a shared file system is no one host's fault"
    every = ranks(("node1", ["checks.command"]), ("node2", ["checks.command"]))
    assert hosts_to_leave_out(every) == [], "every host failed: the fault is not in the hosts"


def test_past_the_budget_the_job_is_not_requeued_and_every_host_is_named(tmp_path: Path) -> None:
    other_job = {**EARLIER, "job": "3", "hosts": ["node9"]}
    not_requeued = {**EARLIER, "hosts": ["node6"], "requeued": False}
    (tmp_path / RECORD).write_text(json.dumps([other_job, EARLIER, not_requeued]))
    config = PreemptConfig(max_node_failures=1)
    environ = {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}
    outcome, line = leave_out(["node2"], FAILED, tmp_path, environ, config)
    assert outcome == "exhausted"
    assert "node failures of job 7: 2, more than preempt.max_node_failures=1: not requeueing" in (
        line
    )
    assert line.endswith("left out before: node5; failed now: node2")
    failures = node_failures(tmp_path)
    assert [(f["job"], f["hosts"], f["requeued"]) for f in failures][-1] == ("7", ["node2"], False)
    assert excluded_hosts(of_job(failures, "7")) == ["node5"], "only hosts left out count"
    assert requeues_for_nodes(tmp_path, "7") == 1 and requeues_for_nodes(tmp_path, "8") == 0


def test_outside_slurm_or_without_requeue_the_refusal_stands(tmp_path: Path) -> None:
    assert leave_out(["node2"], FAILED, tmp_path, {}, PreemptConfig()) == ("refused", "")
    off = PreemptConfig(requeue=False)
    assert leave_out(["node2"], FAILED, tmp_path, {"SLURM_JOB_ID": "7"}, off)[0] == "refused"
    assert not (tmp_path / RECORD).exists(), "nothing recorded where nothing is left out"


def failed_checks(tmp_path: Path) -> tuple[dict[str, Any], Any]:
    settings = RuntimeConfig(run=RunConfig(output_dir=str(tmp_path), id="unit"))
    plan = resolve_launch(settings, "unit", {})
    plan.run_dir.mkdir(parents=True)
    record = {**ranks(("node1", []), ("node2", ["checks.command"])), "failures": FAILED,
              "hosts": ["node2"], "passed": False}  # fmt: skip
    return record, plan


def test_failed_checks_past_the_budget_end_with_their_own_exit_code(tmp_path: Path) -> None:
    record, plan = failed_checks(tmp_path)
    environ = {"SLURM_JOB_ID": "7"}
    config = PreemptConfig(max_node_failures=0)
    with pytest.raises(HpcDdpError) as refused:
        answer_failed_checks(record, plan, config, environ, None, StopSignals("USR1"))
    assert refused.value.exit_code == EXIT_NODES_FAILED == 6
    assert "failed now: node2" in refused.value.message
    assert "raise preempt.max_node_failures" in refused.value.hint
    with redirect_stderr(io.StringIO()) as said:
        assert report_failure(refused.value, "0") == 6
    assert said.getvalue().startswith("[rank 0] error: node failures of job 7: 1, more than")


def test_failed_checks_outside_slurm_are_the_one_line_refusal_and_keep_the_handlers(
    tmp_path: Path,
) -> None:
    record, plan = failed_checks(tmp_path)
    signals = StopSignals("USR1").install()
    installed = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(HpcDdpError) as refused:
            answer_failed_checks(record, plan, PreemptConfig(), {}, None, signals)
        assert signal.getsignal(signal.SIGTERM) is installed, "the stop signals still count"
    finally:
        signals.restore()
    assert refused.value.exit_code == 2
    assert "leave the host(s) out: sbatch --exclude=node2" in refused.value.hint


def test_runs_lists_the_hosts_a_run_left_out_and_why(tmp_path: Path) -> None:
    failures = [EARLIER, {"job": "7", "hosts": ["node2"], "why": FAILED, "restart_count": 1}]
    run = RunView(tmp_path, "lm", "41", "finished", 10, 1, 3, 0.0,
                  left_out=tuple(left_out_lines(failures)))  # fmt: skip
    shown = format_runs(iter([run]), now=0.0).splitlines()
    assert shown[2:] == [
        "lm/41: job 7 attempt 0: node5 failed the checks (node5 (rank 3): devices: NaN): "
        "left out, the job requeued",
        f"lm/41: job 7 attempt 1: node2 failed the checks ({FAILED[0]}): not left out",
    ]


def test_attempts_that_moved_no_checkpoint_forward_are_counted_in_a_row(tmp_path: Path) -> None:
    for restart, step in [(0, 0), (1, 120), (2, 120), (2, 120), (3, 120)]:
        attempts = record_attempt(tmp_path, "7", restart, step)
    assert [a["restart_count"] for a in attempts] == [0, 1, 2, 3], "a torchrun restart: one"
    assert attempts_without_progress(attempts) == 2
    assert no_progress_refusal(attempts, limit=3) is None
    assert no_progress_refusal(attempts, limit=0) is None, "0: no limit"
    refusal = no_progress_refusal([*attempts, {"from_step": 120}], limit=3)
    assert refusal is not None and refusal.exit_code == EXIT_NO_PROGRESS == 7
    assert refusal.message.startswith(
        "the last 3 attempts of this job ended without moving the checkpoint past step 120"
    )
    assert attempts_without_progress([{"from_step": 0}, {"from_step": 5}]) == 0


def test_a_stalled_job_ends_before_training_on_every_rank(tmp_path: Path) -> None:
    settings = RuntimeConfig(
        run=RunConfig(output_dir=str(tmp_path), id="unit"),
        preempt=PreemptConfig(max_attempts_without_progress=2, end_check_every_s=None),
    )
    plan = resolve_launch(settings, "unit", {})
    plan = dataclasses.replace(plan, dist_env=dataclasses.replace(plan.dist_env, restart_count=2))
    plan.run_dir.mkdir(parents=True)
    record_attempt(plan.run_dir, "6", 0, 40)  # another job of the same run
    record_attempt(plan.run_dir, "7", 0, 40)
    record_attempt(plan.run_dir, "7", 1, 40)
    context = RunContext(
        config=settings, plan=plan, control_group=None, signals=StopSignals("USR1"),
        tracker=NullTracker(), environ={"SLURM_JOB_ID": "7", "SLURM_JOB_END_TIME": "0"},
        fingerprint={}, log_interval=None,
    )  # fmt: skip
    position = Position(global_step=40, resumed_from_step=40)
    checkpointer = Checkpointer(
        context, position, MetricLog(context), StreamStates(0, 1), nullcontext
    )
    stopper = Stopper(context, position, checkpointer)
    with pytest.raises(HpcDdpError, match=r"the last 2 attempts of this job") as refused:
        stopper.begin()
    assert refused.value.exit_code == 7
    recorded = json.loads((plan.run_dir / "attempts.json").read_text())
    assert [(a["job"], a["restart_count"], a["from_step"]) for a in recorded] == [
        ("6", 0, 40),
        ("7", 0, 40),
        ("7", 1, 40),
        ("7", 2, 40),
    ]
