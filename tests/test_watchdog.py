"""The stall watchdog on real local gloo ranks: a rank stuck in the user's code or in a
DataLoader worker ends the job within dist.stall_timeout_s and a few seconds, and the log
shows where it is stuck; dist.timeout_s is 600 s, so without the watchdog these runs hang."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hpc_ddp.runtime.errors import EXIT_PEER_LOST, EXIT_STALLED
from hpc_ddp.runtime.preempt.liveness import ProcessStops, RunQueueWaits
from hpc_ddp.runtime.preempt.progress import failure_lines, read_attempts, read_failures
from hpc_ddp.runtime.preempt.stall_report import (
    IN_OWN_CODE,
    INSIDE_TORCH,
    WAITS_FOR_DATA,
    stall_exit_code,
    stuck_in,
    thread_stacks,
    where_stuck,
)
from hpc_ddp.runtime.preempt.watchdog import CHECK_PERIOD_S, StallWatchdog
from tests.helpers import REPO, HandClock, run_local_program

FAULTS = str(REPO / "tests" / "programs" / "faults.py")
#: Long enough that a healthy rank starved of the CPU on a busy machine never reaches it.
STALL_S = 15


def run_stalling(fault: str, tmp_path: Path) -> str:
    """The fault's run, which dist.timeout_s=600 would let hang for 10 minutes: it must end
    well before the 120 s this waits."""
    result = run_local_program(
        2,
        [
            FAULTS,
            fault,
            f"run.output_dir={tmp_path}",
            "run.id=x",
            f"dist.stall_timeout_s={STALL_S}",
            "dist.timeout_s=600",
        ],
        timeout=120,
    )
    assert result.returncode == EXIT_STALLED, result.stderr[-3000:]
    return result.stderr


def stalled_for(line: str) -> float:
    """The seconds without a step a stall report gives."""
    found = re.search(r"no training step finished for (\d+) s", line)
    assert found is not None, line
    return float(found.group(1))


@pytest.mark.e2e
def test_a_rank_sleeping_in_the_users_code_ends_the_job_and_shows_the_frame(
    tmp_path: Path,
) -> None:
    log = run_stalling("sleep", tmp_path)
    # Rank 0, waiting for it inside torch, stalls at the same moment: a consequence (exit 4).
    assert "rank 1 exited with code 5" in log, log[-3000:]
    line = next(line for line in log.splitlines() if "rank 1 stalled" in line)
    assert stalled_for(line) >= STALL_S, line
    assert "step 4 of the run" in line and "epoch 0" in line, line
    assert "faults.py" in line and "wait_for_a_lock_that_never_comes()" in line, line
    # faulthandler's dump of every thread names the sleeping function
    assert re.search(r'faults\.py", line \d+ in wait_for_a_lock_that_never_comes', log), log
    status = json.loads((tmp_path / "faults" / "x" / "status.json").read_text())
    assert status["state"] == "failed"
    # What ended each rank is on record, and `hpc-ddp runs` names the stalled one.
    run_dir = tmp_path / "faults" / "x"
    failures = {failure["rank"]: failure for failure in read_failures(run_dir)}
    assert failures[1]["error"].startswith("stalled: no training step finished for"), failures
    # (after "; " the silent ranks, when rank 0 had ended by then)
    stalled = failures[1]["error"].split("; ")[0]
    assert stalled.endswith(f"(dist.stall_timeout_s={STALL_S}), in its own code"), stalled
    assert re.search(r"faults\.py:\d+ in wait_for_a_lock_that_never_comes$", failures[1]["at"])
    assert failures[1]["step"] == 3 and not failures[1]["follows_another_rank"]
    [said] = failure_lines(read_attempts(run_dir), list(failures.values()))
    assert said.startswith("attempt 1 failed at step 3: rank 1 on "), said


@pytest.mark.e2e
def test_a_hung_dataloader_worker_is_named(tmp_path: Path) -> None:
    log = run_stalling("stuck-worker", tmp_path)
    assert "rank 1 exited with code 5" in log, log[-3000:]
    line = next(line for line in log.splitlines() if "rank 1 stalled" in line)
    assert "waiting for a DataLoader worker" in line and "step 3 of the run" in line, line
    stalled = [f for f in read_failures(tmp_path / "faults" / "x") if f["rank"] == 1]
    kinds = [f["error"].split("; ")[0].rsplit(", ", 1)[-1] for f in stalled]
    assert kinds == [WAITS_FOR_DATA], stalled


def test_where_stuck_names_the_users_frame_of_a_thread() -> None:
    inside, release = threading.Event(), threading.Event()

    def users_slow_function() -> None:
        inside.set()
        release.wait(30)

    thread = threading.Thread(target=users_slow_function)
    thread.start()
    try:
        import sys

        assert inside.wait(30), "the thread never started"
        # Wherever it is now (setting one event, waiting on the other), the frame it is in
        # called from the user's function.
        text = where_stuck(sys._current_frames()[thread.ident or -1])
    finally:
        release.set()
        thread.join()
    assert text.startswith("in ") and "test_watchdog.py" in text, text
    assert "users_slow_function()" in text, text
    assert where_stuck(None) == "no Python frame"
    assert stuck_in(None) == ("no Python frame", None)


def test_the_watchdog_is_overdue_only_past_the_allowed_time_since_a_beat() -> None:
    """Its verdict on a clock moved by hand: the first step is allowed the longer time, then
    each beat restarts the count, and a watch at rest or disarmed is never overdue."""
    clock = HandClock()
    watchdog = StallWatchdog(
        timeout_s=4, first_timeout_s=60, rank=0, where=str, end_run=lambda _: None, clock=clock
    )
    try:
        assert watchdog.overdue() is None, "not armed yet"
        watchdog.arm()
        clock.now += 59
        assert watchdog.overdue() is None, "the first step may take first_timeout_s"
        clock.now += 2
        assert watchdog.overdue() == 61
        watchdog.beat()
        clock.now += 4
        assert watchdog.overdue() is None, "exactly the timeout is not past it"
        clock.now += 0.5
        assert watchdog.overdue() == 4.5
        watchdog.rest()
        clock.now += 100
        assert watchdog.overdue() is None, "the user's code between steps is not watched"
        watchdog.beat()
        with watchdog.paused():
            clock.now += 100
            assert watchdog.overdue() is None, "a checkpoint write is not watched"
        assert watchdog.overdue() is None, "the watch starts again after it"
        clock.now += 5
        assert watchdog.overdue() == 5
    finally:
        watchdog.close()


def test_a_stall_report_goes_out_whole_in_one_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks stall together and faulthandler writes a stack in many small pieces: every
    piece of a rank's report (its lines and every thread's stack) is written while it holds
    the ranks' lock file, so no other rank's report lands inside it."""
    import fcntl
    import os

    from hpc_ddp.runtime.logs import get_logger, setup_logging
    from hpc_ddp.runtime.turns import OutputTurns

    lock_path = tmp_path / "output.lock"
    lock_path.touch()
    other_rank = os.open(lock_path, os.O_RDONLY)
    written: list[tuple[bool, str]] = []

    class Stream:
        """stderr, recording whether another rank could have taken the turn at each write."""

        def write(self, text: str) -> int:
            try:
                fcntl.flock(other_rank, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                written.append((True, text))
            else:
                fcntl.flock(other_rank, fcntl.LOCK_UN)
                written.append((False, text))
            return len(text)

        def flush(self) -> None:
            pass

        def isatty(self) -> bool:
            return False

    monkeypatch.setattr("sys.stderr", Stream())
    monkeypatch.setattr(get_logger(), "handlers", [])  # the test's own, put back after
    setup_logging(rank=1, world_size=2)
    watchdog = StallWatchdog(
        timeout_s=4,
        first_timeout_s=4,
        rank=1,
        where=lambda: "epoch 0, step 5",
        end_run=lambda failure: None,
        output=OutputTurns(str(lock_path)),
    )
    try:
        failure = watchdog.report_stall(7.0)
    finally:
        watchdog.close()
        os.close(other_rank)
    text = "".join(piece for _, piece in written)
    assert [held for held, _ in written] == [True] * len(written), written
    assert "rank 1 stalled: no training step finished for 7 s" in text, text
    assert re.search(r'test_watchdog\.py", line \d+ in test_a_stall_report_goes_out', text)
    assert "rank 1 ends the job" in text.splitlines()[-1], text
    # The record of what ended the rank: the stall, and the line of the test it was in.
    assert failure["error"] == (
        "stalled: no training step finished for 7 s (dist.stall_timeout_s=4), in its own code"
    ), failure
    in_this_test = r".*test_watchdog\.py:\d+ in test_a_stall_report_goes_out_whole_in_one_turn"
    assert re.fullmatch(in_this_test, str(failure["at"])), failure
    assert failure["follows_another_rank"] is False


def test_a_stall_report_shows_the_stacks_without_a_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's TMPDIR may be full or gone: the stacks then go straight to stderr, and the
    report (which ends the rank after it) does not fail."""
    import tempfile

    from hpc_ddp.runtime.logs import get_logger, setup_logging

    def no_temporary_file(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tempfile, "TemporaryFile", no_temporary_file)
    assert thread_stacks() is None
    with open(tmp_path / "stderr", "w+") as stderr:
        monkeypatch.setattr("sys.stderr", stderr)
        monkeypatch.setattr(get_logger(), "handlers", [])
        setup_logging(rank=0, world_size=1)
        watchdog = StallWatchdog(4, 4, rank=0, where=lambda: "step 5", end_run=lambda failure: None)
        try:
            watchdog.report_stall(9.0)
        finally:
            watchdog.close()
        stderr.seek(0)
        text = stderr.read()
    assert "rank 0 stalled: no training step finished for 9 s" in text, text
    assert re.search(r'test_watchdog\.py", line \d+ in test_a_stall_report_shows_the', text)
    assert "rank 0 ends the job" in text.splitlines()[-1], text


def test_a_rank_that_only_waits_inside_torch_exits_as_a_consequence() -> None:
    assert stall_exit_code(INSIDE_TORCH, other_ranks=True) == EXIT_PEER_LOST
    assert stall_exit_code(INSIDE_TORCH, other_ranks=False) == EXIT_STALLED, "alone: its own"
    assert stall_exit_code(WAITS_FOR_DATA, True) == EXIT_STALLED
    assert stall_exit_code(IN_OWN_CODE, True) == EXIT_STALLED


@pytest.mark.parametrize("value", ["0", "-1"])
@pytest.mark.e2e
def test_a_stall_timeout_that_is_not_positive_is_refused(value: str, tmp_path: Path) -> None:
    result = run_local_program(
        1, [FAULTS, "none", f"run.output_dir={tmp_path}", f"dist.stall_timeout_s={value}"]
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"dist.stall_timeout_s={float(value)!r} is invalid" in result.stderr


def test_time_the_process_did_not_run_is_not_a_stall(caplog: pytest.LogCaptureFixture) -> None:
    """On clocks moved by hand (the time, and the process's CPU time): a look at the heartbeat
    that comes long after the one before with no CPU time used meanwhile (the process was
    stopped: SIGSTOP, `scontrol suspend`, a host that hung) leaves that time out, and says so
    once; the watch goes on counting from where it was, and a stall after it still fires. A
    late look after CPU time was used (a thread held the interpreter) or after a wait for a
    CPU (a busy machine) counts the time."""
    clock, cpu, waited = HandClock(), HandClock(0.0), HandClock(0.0)
    watchdog = StallWatchdog(
        timeout_s=4, first_timeout_s=4, rank=1, where=str, end_run=lambda _: None, clock=clock,
        stops=ProcessStops(CHECK_PERIOD_S, clock, cpu, waited),
    )  # fmt: skip
    try:
        watchdog.arm()
        clock.now += 3
        assert watchdog.check() is None
        clock.now += 600.5  # the next look, 10 minutes late: the process did not run
        assert watchdog.check() is None, "a suspension is not a stall"
        assert "rank 1 did not run for 600 s" in caplog.text
        assert "does not count towards dist.stall_timeout_s" in caplog.text
        clock.now += 0.5
        assert watchdog.check() is None, "4 s counted: 3 before, one look's 0.5 s, 0.5 after"
        clock.now += 1
        assert watchdog.check() == 5.0, "the time before the stop still counts"
        watchdog.beat()
        clock.now += 4.75
        assert watchdog.check() == 4.75, "a look 4.75 s after the last (a busy machine) counts"
        watchdog.beat()
        clock.now += 30.5  # stopped again: counted the same way, not said again
        assert watchdog.check() is None
        assert caplog.text.count("did not run for") == 1
        watchdog.beat()
        clock.now += 10.5
        cpu.now += 10.0  # the main thread held the interpreter: the process ran
        assert watchdog.check() == 10.5, "a long hold of the interpreter is a stall"
        watchdog.beat()
        clock.now += 8.5
        cpu.now += 1.0
        waited.now += 7.0  # runnable, waiting for a CPU the machine's other work held
        assert watchdog.check() == 8.5, "a busy machine is no suspension"
        assert caplog.text.count("did not run for") == 1
    finally:
        watchdog.close()


def test_a_threads_wait_for_a_cpu_stays_counted_after_it_ends(tmp_path: Path) -> None:
    """/proc/self/task as files written by hand: a thread that ends keeps its part, one
    that begins counts from 0, a number used again by a new thread counts from 0 too."""

    def threads(**run_delay_ns: int) -> None:
        for old in tmp_path.iterdir():
            (old / "schedstat").unlink()
            old.rmdir()
        for thread, waited in run_delay_ns.items():
            (tmp_path / thread).mkdir()
            (tmp_path / thread / "schedstat").write_text(f"5000 {waited} 7\n")

    waits = RunQueueWaits(tmp_path)
    threads(t1=1_000_000_000, t2=500_000_000)
    assert waits() == 0.0, "counted from the first call"
    threads(t1=3_000_000_000, t2=600_000_000, t3=250_000_000)
    assert waits() == pytest.approx(2.0 + 0.1 + 0.25)
    threads(t1=3_500_000_000)  # t2 and t3 ended
    assert waits() == pytest.approx(2.85)
    threads(t1=3_500_000_000, t2=100_000_000)  # t2's number, a new thread
    assert waits() == pytest.approx(2.95)
    assert RunQueueWaits(tmp_path / "none")() == 0.0


@pytest.mark.skipif(
    not Path("/proc/self/schedstat").exists(), reason="this kernel keeps no run_delay"
)
@pytest.mark.e2e
def test_the_wait_for_a_cpu_on_a_busy_machine_is_read_from_the_kernel() -> None:
    """What tells a busy machine from a stopped process: a thread of this process and a busy
    process pinned to the same CPU take turns on it, so while the thread uses 0.3 s of CPU
    time it waits, runnable, for about as long (at least 0.1 s, more on a busier machine)."""
    cpu = min(os.sched_getaffinity(0))
    spin = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nprint(flush=True)\nwhile True: pass"
    busy = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
    waits = RunQueueWaits()
    waited: list[float] = []

    def share_the_cpu() -> None:
        os.sched_setaffinity(0, {cpu})  # this thread only
        before, used = waits(), time.thread_time()
        while time.thread_time() - used < 0.3:
            pass
        waited.append(waits() - before)

    try:
        assert busy.stdout is not None and busy.stdout.readline() == "\n", "pinned, spinning"
        sharing = threading.Thread(target=share_the_cpu)
        sharing.start()
        sharing.join()
    finally:
        busy.kill()
        busy.wait()
    assert waited and waited[0] >= 0.1, waited
    assert waits() >= waited[0], "the thread ended: its wait stays counted"


@pytest.mark.parametrize("stopped", [1, 0], ids=["rank-1", "rank-0-holding-the-store"])
@pytest.mark.e2e
def test_a_stall_report_names_the_rank_that_stopped_answering(stopped: int, tmp_path: Path) -> None:
    """A rank stopped with SIGSTOP makes no report of its own: the rank waiting for it in a
    collective fires, and its report names the stopped rank (or, when that rank holds the
    rendezvous store, says the store does not answer either)."""
    result = run_local_program(
        2,
        [
            "--set",
            f"run.output_dir={tmp_path}",
            str(REPO / "tests/programs/stops_itself.py"),
            str(stopped),
        ],
    )
    # The waiting rank waits inside torch: a consequence of the other's silence (exit 4).
    assert result.returncode == EXIT_PEER_LOST, result.stderr[-3000:]
    waiting = 1 - stopped
    # The launcher names the stopped rank at once: it cannot end by itself, so it is not
    # waited for.
    assert f"hpc-ddp local: rank {stopped}'s process is stopped (SIGSTOP" in result.stderr
    report = next(line for line in result.stderr.splitlines() if f"rank {waiting} stalled" in line)
    if stopped == 1:
        node = re.escape(socket.gethostname())  # outside Slurm: the host's name
        silent = rf"these ranks stopped answering: rank 1 on {node} \(silent for \d+ s\)"
        assert re.search(silent, report), report
    else:
        assert "the rendezvous store at 127.0.0.1" in report and "does not answer" in report


def test_the_silent_ranks_are_found_on_this_rank_s_own_clock() -> None:
    """Each rank writes a count, not a time: rank 1, which wrote long before and whose
    host's clock may be an hour off, is silent because its count did not move between the
    two reads; rank 2's moved (it wrote meanwhile), so it is not named, whatever its clock;
    rank 3 never wrote. The wait between the reads and the clock are this test's
    (a real TCPStore in this process, on 127.0.0.1)."""
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from hpc_ddp.runtime.preempt.liveness import Liveness

    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    server.set("hpc_ddp/alive/0/1", "7 node2 in the training loop")
    server.set("hpc_ddp/alive/0/2", "7 node1 in the training loop")
    now = [100.0]

    def between_reads(seconds: float) -> None:
        server.set("hpc_ddp/alive/0/2", "8 node1 in the training loop")
        now[0] += seconds

    liveness = Liveness("127.0.0.1", server.port, 0, 4, 0, between_reads, lambda: now[0])
    try:
        report = liveness.silent_ranks()
    finally:
        liveness.close()
    assert report.startswith(
        "these ranks stopped answering: rank 1 on node2 (silent for 3 s), rank 3 (never)"
    )
    assert "rank 2" not in report


#: dist.timeout_s for a collective one rank never makes: well past a busy machine's pauses.
COLLECTIVE_TIMEOUT_S = 20
ALONE_IN_A_COLLECTIVE = """
import threading
import hpc_ddp

run = hpc_ddp.start(tracking={"enabled": False}, checkpoint={"enabled": False})
sums = run.sums()
sums.add("loss", 1.0)
if run.rank == 0:
    sums.reduce()  # the other rank never makes this call
else:
    threading.Event().wait()  # busy elsewhere until the launcher stops it
run.finish()
"""


@pytest.mark.e2e
def test_a_collective_only_one_rank_makes_ends_in_dist_timeout_s_naming_the_call(
    tmp_path: Path,
) -> None:
    """hpc_ddp's own groups (the metric sums go over its gloo control group) take
    dist.timeout_s, not torch's 30 minutes: rank 0 alone in run.sums().reduce() ends the
    job after it, in one line that names the script's line, without a traceback."""
    script = tmp_path / "alone.py"
    script.write_text(ALONE_IN_A_COLLECTIVE)
    result = run_local_program(
        2,
        [
            "--set",
            f"run.output_dir={tmp_path}",
            "--set",
            f"dist.timeout_s={COLLECTIVE_TIMEOUT_S}",
            # (no checks: rank 0 alone writes the run directory's check; on a busy machine
            # the other rank's check all-reduce could wait that long for it)
            "--set",
            "checks.enabled=false",
            str(script),
        ],
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert (
        f"[rank 0] stopped: a collective waited {COLLECTIVE_TIMEOUT_S} s (dist.timeout_s) for "
        f"the other ranks, "
        f"called at {script}:9: another rank did not make the same call in that time"
        in result.stderr
    ), result.stderr[-3000:]
    assert "Traceback" not in result.stderr


UNEVEN_BATCHES = """
import torch
import hpc_ddp

run = hpc_ddp.start(tracking={"enabled": False}, checkpoint={"enabled": False})
model = run.wrap(torch.nn.Linear(2, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
{loop}
run.finish()
"""
RAN_OUT = """
batches = (torch.ones(4, 2) for _ in range(6 if run.rank == 0 else 3))
for batch in run.steps(batches):
    model(batch).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
"""
BROKE_OUT = """
for step in run.iterations(6):
    if run.rank == 1 and step == 2:
        break
    model(torch.ones(4, 2)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
"""


@pytest.mark.parametrize(
    ("loop", "named"),
    [
        (RAN_OUT, "rank 1 left the training loop after step 3: its batches ran out"),
        (BROKE_OUT, "rank 1 left the training loop after step 2: it broke out of the loop"),
    ],
    ids=["batches-ran-out", "break"],
)
@pytest.mark.e2e
def test_a_stall_report_names_the_rank_that_left_the_loop_early(
    loop: str, named: str, tmp_path: Path
) -> None:
    """Rank 1 leaves the loop while rank 0 goes on: rank 0 waits for it in the next step's
    gradient all-reduce until its stall watchdog fires, and its report names rank 1 and why
    (until now it blamed no one, or "a rank stalled in its own code")."""
    script = tmp_path / "uneven.py"
    script.write_text(UNEVEN_BATCHES.replace("{loop}", loop))
    result = run_local_program(
        2,
        [
            "--set",
            f"run.output_dir={tmp_path}",
            "--set",
            f"dist.stall_timeout_s={STALL_S}",
            "--set",
            "dist.timeout_s=600",
            str(script),
        ],
        timeout=120,
    )
    assert result.returncode in (EXIT_PEER_LOST, EXIT_STALLED), result.stderr[-3000:]
    report = next(line for line in result.stderr.splitlines() if "rank 0 stalled" in line)
    assert named in report, report
    assert "while this rank went on" in report, report
