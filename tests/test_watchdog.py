"""The stall watchdog on real local gloo ranks: a rank stuck in the user's code or in a
DataLoader worker ends the job within dist.stall_timeout_s and a few seconds, and the log
shows where it is stuck; dist.timeout_s is 600 s, so without the watchdog these runs hang."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from hpc_ddp.runtime.errors import EXIT_STALLED
from hpc_ddp.runtime.preempt.watchdog import where_stuck
from tests.helpers import REPO, run_local_program

FAULTS = str(REPO / "tests" / "programs" / "faults.py")
STALL_S = 4


def run_stalling(fault: str, tmp_path: Path) -> tuple[str, float]:
    started = time.monotonic()
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
    elapsed = time.monotonic() - started
    assert result.returncode == EXIT_STALLED, result.stderr[-3000:]
    return result.stderr, elapsed


def test_a_rank_sleeping_in_the_users_code_ends_the_job_and_shows_the_frame(
    tmp_path: Path,
) -> None:
    log, elapsed = run_stalling("sleep", tmp_path)
    # Start-up and three steps take a few seconds; the stall is seen within STALL_S + 0.5 s.
    assert elapsed < STALL_S + 25, elapsed
    assert "rank 1 exited with code 5" in log, log[-3000:]
    line = next(line for line in log.splitlines() if "rank 1 stalled" in line)
    assert "step 4 of the run" in line and "epoch 0" in line, line
    assert "faults.py" in line and "wait_for_a_lock_that_never_comes()" in line, line
    # faulthandler's dump of every thread names the sleeping function
    assert re.search(r'faults\.py", line \d+ in wait_for_a_lock_that_never_comes', log), log
    status = json.loads((tmp_path / "faults" / "x" / "status.json").read_text())
    assert status["state"] == "failed"


def test_a_hung_dataloader_worker_is_named(tmp_path: Path) -> None:
    log, elapsed = run_stalling("stuck-worker", tmp_path)
    assert elapsed < STALL_S + 25, elapsed
    stalled = [line for line in log.splitlines() if " stalled: " in line]
    assert stalled, log[-3000:]
    rank_1 = [line for line in stalled if "rank 1 stalled" in line]
    if rank_1:  # rank 0 may end the job first, waiting for rank 1 inside torch
        assert "waiting for a DataLoader worker" in rank_1[0], rank_1[0]
        assert "step 3 of the run" in rank_1[0], rank_1[0]
    else:
        assert "rank 0 stalled" in stalled[0] and "inside torch" in stalled[0], stalled


def test_where_stuck_names_the_users_frame_of_a_thread() -> None:
    release = threading.Event()

    def users_slow_function() -> None:
        release.wait(30)

    thread = threading.Thread(target=users_slow_function)
    thread.start()
    try:
        import sys

        time.sleep(0.2)
        frame = sys._current_frames()[thread.ident or -1]
        text = where_stuck(frame)
    finally:
        release.set()
        thread.join()
    assert text.startswith("in ") and "test_watchdog.py" in text, text
    assert "users_slow_function()" in text, text
    assert where_stuck(None) == "no Python frame"


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_stall_timeout_that_is_not_positive_is_refused(value: str, tmp_path: Path) -> None:
    result = run_local_program(
        1, [FAULTS, "none", f"run.output_dir={tmp_path}", f"dist.stall_timeout_s={value}"]
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"dist.stall_timeout_s={float(value)!r} is invalid" in result.stderr


@pytest.mark.parametrize("stopped", [1, 0], ids=["rank-1", "rank-0-holding-the-store"])
def test_a_stall_report_names_the_rank_that_stopped_answering(stopped: int) -> None:
    """A rank stopped with SIGSTOP makes no report of its own: the rank waiting for it in a
    collective fires, and its report names the stopped rank (or, when that rank holds the
    rendezvous store, says the store does not answer either)."""
    result = run_local_program(
        2, [str(REPO / "tests/programs/stops_itself.py"), str(stopped)], timeout=120
    )
    assert result.returncode == EXIT_STALLED, result.stderr[-3000:]
    waiting = 1 - stopped
    report = next(line for line in result.stderr.splitlines() if f"rank {waiting} stalled" in line)
    if stopped == 1:
        assert re.search(r"these ranks stopped answering: rank 1 \(\d+ s ago\)", report), report
    else:
        assert "the rendezvous store at 127.0.0.1" in report and "does not answer" in report
