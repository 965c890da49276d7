"""A rank lost to its host, in this process: which of srun's task endings blame the host,
the rank's own report of a failed device, rank 0's hand-off to the batch script, and the
batch script's answer where nothing is to be left out. Leaving the host out and the requeue
need scontrol: test_slurm_fault_tolerance.py runs them on the real test cluster."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
from contextlib import redirect_stderr
from pathlib import Path

import pytest

from hpc_ddp.launch.step_failure import ONE_TASK_PER_NODE, answer
from hpc_ddp.runtime.config import PreemptConfig
from hpc_ddp.runtime.errors import EXIT_DEVICE_ERROR, EXIT_FAILURE
from hpc_ddp.runtime.exits import report_failure
from hpc_ddp.runtime.logs import LOGGER_NAME
from hpc_ddp.runtime.preempt.lost_rank import (
    HANDOFF_VARIABLE,
    LostRank,
    blamed_host,
    lost_rank,
    read_handoff,
    silent_rank,
    torchrun_lost_rank,
    withdraw_handoff,
    write_handoff,
)
from hpc_ddp.runtime.preempt.node_record import left_out_lines
from hpc_ddp.runtime.preempt.requeue import requeue_job

STEP_ENDED_BY_SRUN = [
    "srun: launch/slurm: _step_signal: Terminating StepId=185.0",
    "0: slurmstepd-node1: error: *** STEP 185.0 ON node1 CANCELLED AT 2026-11-27T18:59:30 ***",
    "srun: error: node2: task 2: Terminated",
    "srun: error: node1: tasks 0-1: Terminated",
    "srun: Force Terminated StepId=185.0",
]


@pytest.mark.parametrize(
    ("first", "lost"),
    [
        ("srun: error: node2: task 3: Killed",
         LostRank("node2", "task 3 on node2 was killed by SIGKILL")),
        ("srun: error: gpu-07: tasks 4-5: Segmentation fault (core dumped)",
         LostRank("gpu-07", "tasks 4-5 on gpu-07 were killed by SIGSEGV")),
        ("srun: error: node2: task 1: Aborted (core dumped)", None),
        ("srun: error: node2: task 1: Bus error",
         LostRank("node2", "task 1 on node2 was killed by SIGBUS")),
        (f"srun: error: node3: task 0: Exited with exit code {EXIT_DEVICE_ERROR}",
         LostRank("node3", "task 0 on node3 reported a failed device")),
        ("srun: error: node2: task 3: Exited with exit code 1", None),
        ("srun: error: node2: task 3: Exited with exit code 3", None),
        ("srun: error: node2: task 3: Terminated", None),
        ("srun: error: node2: task 3: Interrupt", None),
    ],
)  # fmt: skip
def test_only_the_first_tasks_ending_of_the_hosts_kind_blames_its_host(
    first: str, lost: LostRank | None
) -> None:
    lines = ["1: epoch 0 step 12/32 train_loss 2.3", first, *STEP_ENDED_BY_SRUN]
    assert lost_rank(lines) == lost


def test_an_out_of_memory_kill_or_a_step_with_no_ending_blames_no_host() -> None:
    oom = "slurmstepd: error: Detected 1 oom_kill event in StepId=185.0. Some of the step "
    assert lost_rank(["srun: error: node2: task 3: Killed", oom + "tasks have been killed"]) is None
    assert lost_rank(["1: a line of the program", *STEP_ENDED_BY_SRUN[:2]]) is None
    # Endings after the first follow from it: srun's SIGTERM of the step's other tasks.
    later = [
        "srun: error: node1: task 0: Exited with exit code 1",
        "srun: error: node2: task 1: Killed",
    ]
    assert lost_rank(later) is None


def test_a_rank_that_only_lost_its_peer_is_passed_over_and_srun_found_mid_line() -> None:
    # The peer's ending may reach srun first; a rank's last words may lack a newline.
    lines = ["srun: error: node1: task 0: Exited with exit code 4",
             "1: partial outputsrun: error: node2: task 1: Killed"]  # fmt: skip
    assert lost_rank(lines) == LostRank("node2", "task 1 on node2 was killed by SIGKILL")
    memory = "slurmstepd: error: Exceeded job memory limit"
    assert lost_rank([*lines, memory]) is None


RAN_OUT = "rank 3 on node2 (torchrun's restarts ran out)"


def torchrun_report(task: str, exitcode: str, rank: int = 3) -> list[str]:
    """torchrun's report when its restarts ran out (torch.distributed.elastic's
    ChildFailedError), as srun's --label passes it on from node ``task``'s agent."""
    report = [
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "=" * 60, "train.py FAILED", "-" * 60, "Failures:", "  <NO_OTHER_FAILURES>", "-" * 60,
        "Root Cause (first observed failure):", "[0]:",
        "  time      : 2026-11-28_20:31:07",
        "  host      : vm",  # every node of the test cluster shares one hostname
        f"  rank      : {rank} (local_rank: 1)",
        f"  exitcode  : {exitcode} (pid: 4242)",
        "  error_file: <N/A>", "  traceback : Signal 9 (SIGKILL) received by PID 4242", "=" * 60,
    ]  # fmt: skip
    return [f"{task}: {line}" for line in report]


@pytest.mark.parametrize(
    ("exitcode", "why"),
    [
        ("-9 SIGKILL", f"{RAN_OUT} was killed by SIGKILL"),
        ("-11 SIGSEGV", f"{RAN_OUT} was killed by SIGSEGV"),
        (str(EXIT_DEVICE_ERROR), f"{RAN_OUT} reported a failed device"),
        ("1", None),
        ("-6 SIGABRT", None),
    ],
)  # fmt: skip
def test_under_torchrun_its_last_rounds_root_cause_blames_the_node_of_its_agent(
    exitcode: str, why: str | None
) -> None:
    # Node 0's agent reports first: its worker only lost its peer (exit code 4).
    lines = ["0: [rank 0/4] INFO epoch 0 step 12/32", *torchrun_report("0", "4", rank=0),
             *torchrun_report("1", exitcode),
             "srun: error: node2: task 1: Exited with exit code 1",
             "srun: error: node1: task 0: Terminated"]  # fmt: skip
    assert lost_rank(lines) is None, "srun's own endings blame no host: torchrun exited 1"
    expected = LostRank("node2", why) if why else None
    assert torchrun_lost_rank(lines, ["node1", "node2"]) == expected
    # srun's own words name the agent's node, whatever the node list's order.
    assert torchrun_lost_rank(lines, ["nodeA", "nodeB"]) == expected
    without_srun = lines[:-2]
    assert torchrun_lost_rank(without_srun, ["node1", "node2"]) == expected
    assert torchrun_lost_rank(without_srun, ["node1"]) is None, "a task beyond the job's nodes"
    unlabelled = [line.split(": ", 1)[1] for line in lines[1:-2]]
    assert torchrun_lost_rank(unlabelled, ["node1", "node2"]) is None, "no label, no node"
    assert torchrun_lost_rank(lines[:17], ["node1", "node2"]) is None, "a peer lost blames none"


def test_the_batch_script_reads_torchruns_report_only_under_the_torchrun_template(
    tmp_path: Path,
) -> None:
    lines = [
        *torchrun_report(" 1", "-9 SIGKILL"),
        "srun: error: node2: task 1: Exited with exit code 1",
    ]
    environ = {"SLURM_JOB_ID": "185", "SLURM_JOB_NODELIST": "node[1-2]",
               HANDOFF_VARIABLE: str(tmp_path / "none.json")}  # fmt: skip
    stderr = io.StringIO()
    with redirect_stderr(stderr):
        assert answer(1, lines, environ) == 1
        assert stderr.getvalue() == "", "slurm/train.sh: a task is a rank, not a node"
        assert answer(1, lines, {**environ, ONE_TASK_PER_NODE: "1"}) == 1
    assert stderr.getvalue().startswith(
        "hpc-ddp: rank 3 on node2 (torchrun's restarts ran out) was killed by SIGKILL; rank 0 "
        "said nothing of its run, so node2 is not left out"
    )


def test_a_rank_killed_while_it_reports_its_own_stall_blames_no_host() -> None:
    """The rank stalled in its own code writes its report (a read of the others' liveness,
    the run's end) while its peer, waiting inside torch, exits at once: srun may then kill
    it. The stall is the program's, not its host's."""
    stalled = (
        "1: 21:04:46 [rank 1/2] ERROR rank 1 stalled: no training step finished for 20 s "
        "(dist.stall_timeout_s=20) at epoch 0, step 4; its main thread is in train.py:9"
    )
    lines = [stalled, "srun: error: node1: task 0: Exited with exit code 4",
             "srun: error: node2: task 1: Killed"]  # fmt: skip
    assert lost_rank(lines) is None
    assert blamed_host(lines, None) is None
    killed = LostRank("node2", "task 1 on node2 was killed by SIGKILL")
    other = stalled.replace("1: ", "0: ", 1).replace("rank 1", "rank 0")
    assert lost_rank([other, *lines[1:]]) == killed, "another task's stall does not excuse it"
    device = stalled.replace("is in train.py:9", "is inside torch, waiting for other ranks or "
                             "the device (called from train.py:9)")  # fmt: skip
    assert lost_rank([device, *lines[1:]]) == killed, "one waiting for its device may be the host's"
    # Under the torchrun template srun's task is a node's agent, and its label is the task's.
    agent = stalled.replace("[rank 1/2] ERROR rank 1", "[rank 3/4] ERROR rank 3")
    assert lost_rank([agent, *lines[1:]]) is None


def test_a_rank_a_stall_report_names_as_silent_blames_its_node() -> None:
    report = (
        "0: 21:04:46 [rank 0/2] ERROR rank 0 ends the job: stalled inside torch; these ranks "
        "stopped answering: rank 1 on node2 (silent for 3 s), rank 3 on node3 (silent for 3 s) "
        "(stopped, frozen, or their host is gone)"
    )
    lines = [report, "srun: error: node1: task 0: Exited with exit code 4",
             "srun: error: node2: task 1: Exited with exit code 4"]  # fmt: skip
    assert lost_rank(lines) is None, "every task only lost its peer"
    assert silent_rank(lines) == LostRank("node2", "rank 1 on node2 stopped answering")
    unknown_host = [report.replace("on node2", "on ?")]  # a rank whose node is not known
    assert silent_rank(unknown_host) == LostRank("node3", "rank 3 on node3 stopped answering")
    assert silent_rank([report.replace("on node2", "on ?").replace("on node3", "on ?")]) is None
    assert silent_rank(["these ranks stopped answering: rank 3 (never)"]) is None
    frozen = LostRank("node2", "rank 1 on node2 stopped answering")
    assert blamed_host(lines, None) == frozen
    assert blamed_host([*lines, "srun: error: node1: task 2: Terminated"], None) == frozen
    # Woken to be ended, the frozen rank may not end before srun's KillWait: its kill is
    # the consequence; the report says why its node is left out.
    killed = [report, "srun: error: node1: task 0: Exited with exit code 4",
              "srun: error: node2: task 1: Killed"]  # fmt: skip
    assert lost_rank(killed) == frozen
    node3 = [*killed[:2], "srun: error: node3: task 3: Killed"]
    assert lost_rank(node3) == LostRank("node3", "rank 3 on node3 stopped answering")
    elsewhere = LostRank("node4", "task 1 on node4 was killed by SIGKILL")
    assert lost_rank([*killed[:2], "srun: error: node4: task 1: Killed"]) == elsewhere
    # A program's own ending is not overruled by a stall report in the same log.
    assert (
        blamed_host([report, "srun: error: node1: task 0: Exited with exit code 1"], None) is None
    )
    oom = "slurmstepd: error: Detected 1 oom_kill event in StepId=185.0"
    assert blamed_host([*lines, oom], None) is None
    # Under torchrun the log holds every round's reports: only torchrun's last one counts.
    assert blamed_host(lines, ["node1", "node2"]) is None


def test_a_device_error_ends_the_rank_with_its_own_exit_code_and_traceback() -> None:
    def step() -> None:
        raise RuntimeError("CUDA error: uncorrectable ECC error encountered")

    # The device's words may sit in an exception the user's code raised from it.
    stderr = io.StringIO()
    try:
        try:
            step()
        except RuntimeError as cause:
            raise ValueError("the step failed") from cause
    except ValueError as error:
        with redirect_stderr(stderr):
            assert report_failure(error, "1") == EXIT_DEVICE_ERROR
    assert "[rank 1] device failed (CUDA error: uncorrectable ECC error encountered)" in (
        stderr.getvalue()
    )
    assert "in step" in stderr.getvalue() and "ValueError: the step failed" in stderr.getvalue()
    with redirect_stderr(io.StringIO()):
        assert report_failure(RuntimeError("CUDA error: device-side assert triggered"), "1") == (
            EXIT_FAILURE
        )


def test_rank_0_hands_the_run_and_its_settings_to_the_batch_script(tmp_path: Path) -> None:
    config = PreemptConfig(max_node_failures=5, requeue_delay_s=30.0)
    environ = {HANDOFF_VARIABLE: str(tmp_path / "handoff.json")}
    write_handoff(environ, tmp_path / "run", config, "setup")
    assert read_handoff(environ) == (tmp_path / "run", config, "setup")
    write_handoff(environ, tmp_path / "run", config, "training")
    assert read_handoff(environ) == (tmp_path / "run", config, "training")
    assert read_handoff({}) is None
    assert read_handoff({HANDOFF_VARIABLE: str(tmp_path / "none.json")}) is None
    (tmp_path / "handoff.json").write_text('{"run_dir": "x"}')
    assert read_handoff(environ) is None
    (tmp_path / "handoff.json").write_text('{"run_dir": "x", "preempt": {"max_node_failures": -1}}')
    assert read_handoff(environ) is None  # settings no run would start with
    (tmp_path / "handoff.json").unlink()
    write_handoff(environ, tmp_path / "run", config, "training")
    (tmp_path / "link.json").symlink_to(tmp_path / "handoff.json")
    assert read_handoff({HANDOFF_VARIABLE: str(tmp_path / "link.json")}) is None
    (tmp_path / "link.json").unlink()
    write_handoff({}, tmp_path / "run", config, "training")  # no file asked for: nothing written
    assert sorted(path.name for path in tmp_path.iterdir()) == ["handoff.json"]
    withdraw_handoff(environ)  # the run was found finished: a rank lost now changes nothing
    assert read_handoff(environ) is None and not (tmp_path / "handoff.json").exists()


def test_the_batch_script_keeps_sruns_status_when_no_host_is_to_blame(tmp_path: Path) -> None:
    killed = ["srun: error: node2: task 1: Killed", *STEP_ENDED_BY_SRUN]
    stderr = io.StringIO()
    with redirect_stderr(stderr):
        assert answer(143, ["srun: error: node2: task 1: Exited with exit code 1"], {}) == 143
        assert stderr.getvalue() == ""
        # Killed, but rank 0 never said where the run is (lost before it claimed the run's
        # directory).
        environ = {"SLURM_JOB_ID": "185", HANDOFF_VARIABLE: str(tmp_path / "none.json")}
        assert answer(137, killed, environ) == 137
    assert stderr.getvalue() == (
        "hpc-ddp: task 1 on node2 was killed by SIGKILL; rank 0 said nothing of its run, so "
        "node2 is not left out and the job not requeued\nHINT: a rank lost before rank 0 "
        "claimed the run's directory (while Python imported, or rank 0's own host lost) ends "
        "the job; resubmit it with --exclude=node2\n"
    )


def test_runs_says_a_host_lost_a_rank() -> None:
    failure = {"job": "185", "restart_count": 0, "hosts": ["node2"], "event": "lost a rank",
               "why": ["task 1 on node2 was killed by SIGKILL"], "requeued": True}  # fmt: skip
    assert left_out_lines([failure]) == [
        "job 185 attempt 0: node2 lost a rank (task 1 on node2 was killed by SIGKILL): "
        "left out, the job requeued"
    ]


@pytest.mark.e2e
def test_scontrol_requeue_outlives_the_sigterm_its_requeue_sends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Slurm sends the step SIGTERM as `scontrol requeue` ends it; the scontrol that rank 0
    started must still report. A stand-in scontrol (no Slurm here) sends itself that SIGTERM
    before it answers: started with SIGTERM at its default it would die, and the requeue
    would count as failed."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(
        '#!/bin/sh\nif [ "$1" = show ]; then echo "JobId=7 Requeue=1 Restarts=0"; exit 0; fi\n'
        'kill -TERM $$\necho "requeue $2" > "$(dirname "$0")/requeued"\n'
    )
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    before = signal.getsignal(signal.SIGTERM)
    with redirect_stderr(io.StringIO()), caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        assert requeue_job({"SLURM_JOB_ID": "7"}, 0, PreemptConfig())
    assert (tmp_path / "requeued").read_text() == "requeue 7\n"
    assert "requeued job 7 (the job's requeue 1 of at most 3, preempt.max_requeues)" in caplog.text
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_second_rank_lost_before_training_in_a_row_ends_the_job(tmp_path: Path) -> None:
    """The attempt before this one was requeued after a rank lost before training: a second
    loss in the same phase is likelier the program's own start than another bad host."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    environ = {"SLURM_JOB_ID": "185", "SLURM_RESTART_COUNT": "1",
               HANDOFF_VARIABLE: str(tmp_path / "handoff.json")}  # fmt: skip
    write_handoff(environ, run_dir, PreemptConfig(), "setup")
    (run_dir / "excluded_hosts.json").write_text(json.dumps([
        {"job": "185", "hosts": ["node3"], "event": "lost a rank before training",
         "why": ["task 1 on node3 was killed by SIGKILL"], "restart_count": 0, "requeued": True},
    ]))  # fmt: skip
    killed = ["srun: error: node2: task 1: Killed", *STEP_ENDED_BY_SRUN]
    stderr = io.StringIO()
    with redirect_stderr(stderr):
        assert answer(137, killed, environ) == 137
    assert stderr.getvalue().startswith(
        "hpc-ddp: task 1 on node2 was killed by SIGKILL before training, as in this job's "
        "attempt before: the program's own start, not a host, is the likelier cause; not "
        "requeueing\nHINT: run it outside the job (hpc-ddp local)"
    )
    assert len(json.loads((run_dir / "excluded_hosts.json").read_text())) == 1, "nothing added"
