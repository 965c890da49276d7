"""Rank 0's progress on a terminal (a real pseudo-terminal as the script's stderr): a bar
that redraws with rate and ETA, and log lines that never land on the bar's line; in batch
logs, one line per interval."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from tests.helpers import REPO, clean_environ

pytestmark = pytest.mark.e2e  # every test here starts processes

PROGRAM = str(REPO / "tests" / "programs" / "regression.py")


#: tqdm redraws at most once per TQDM_MININTERVAL seconds (0.1 by default): at 0 it draws at
#: every move, so what is drawn depends on the steps alone, not on how fast they run.
EVERY_MOVE = {"TQDM_MININTERVAL": "0"}


def run_on_a_terminal(args: list[str]) -> str:
    main, secondary = pty.openpty()
    # A terminal 120 columns wide, as a user's would be (a new pty reports 0 x 0).
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    process = subprocess.Popen(
        [sys.executable, PROGRAM, *args], cwd=REPO, env=clean_environ(**EVERY_MOVE),
        stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary,
    )  # fmt: skip
    os.close(secondary)
    output = read_terminal(main)
    assert process.wait(timeout=120) == 0, output[-3000:]
    return output


def read_terminal(main: int) -> str:
    """Everything written to the pty whose main side is ``main``, until its other side
    closes (the process is gone); closes ``main``."""
    chunks = []
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the terminal's other side closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main)
    return b"".join(chunks).decode(errors="replace")


def test_the_bar_redraws_with_rate_and_eta_and_log_lines_stay_off_it(tmp_path: Path) -> None:
    output = run_on_a_terminal(
        ["--epochs", "2", "--samples", "9600", "--log-interval", "5",
         "preempt.check_every_steps=5", f"run.output_dir={tmp_path}", "tracking.enabled=false"],
    )  # fmt: skip
    drawn = [int(n) for n in re.findall(r"\| *(\d+)/200 \[", output)]
    assert sorted(set(drawn)) == list(range(5, 201, 5)), output[-2000:]  # every interval
    assert drawn == sorted(drawn) and drawn[-1] == 200, "the bar moves forward to the end"
    timed = [int(n) for n in re.findall(r"\| *(\d+)/200 \[\d\d:\d\d<\d\d:\d\d", output)]
    assert set(timed) == set(range(10, 201, 5)), "an ETA from the second draw on"
    assert re.search(r"epoch 1: .*mse \d\.\d{4} .*samples/s", output), "metrics on the bar"
    assert re.search(r"\d+\.\d+ ?steps?/s|s/steps?", output), "tqdm's rate"
    lines = [line.split("\r")[-1] for line in output.replace("\r\n", "\n").split("\n")]
    logged = [line for line in lines if "INFO checkpoint (end of training)" in line]
    assert len(logged) == 1 and re.match(r"\x1b?\[?[A-Z]?\d\d:\d\d:\d\d \[rank 0/1\]", logged[0])
    assert "/200 [" not in logged[0], "the log line is not on the bar's line"
    assert "INFO epoch 0 step" not in output, "no interval log lines under a bar"


def test_batch_logs_get_one_line_per_interval(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, PROGRAM, "--epochs", "1", "--log-interval", "10",
         f"run.output_dir={tmp_path}", "tracking.enabled=false"],
        cwd=REPO, env=clean_environ(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    steps = re.findall(r"\[rank 0/1\] INFO epoch 0 step (\d+)/50 mse", result.stderr)
    assert steps == ["10", "20", "30", "40", "50"]
    assert "\r" not in result.stderr


def test_the_bar_moves_between_intervals_and_ends_at_the_last_step(tmp_path: Path) -> None:
    """Metrics every 60 steps, stop checks every 10: the bar moves at the checks (no work per
    step) and shows 200/200 at the end, though no interval ends there. The bar appears with
    the first interval's metrics (step 60, published at the end of epoch 0)."""
    output = run_on_a_terminal(
        ["--epochs", "2", "--samples", "9600", "--log-interval", "60",
         "preempt.check_every_steps=10", f"run.output_dir={tmp_path}", "tracking.enabled=false"],
    )  # fmt: skip
    drawn = [int(n) for n in re.findall(r"\| *(\d+)/200 \[", output)]
    assert drawn[-1] == 200, output[-2000:]
    assert set(drawn) == {60, *range(110, 201, 10)}, f"each check after the bar appeared: {drawn}"


def test_log_lines_written_around_the_bar_stay_on_stderr(tmp_path: Path) -> None:
    """tqdm writes around a bar to stdout unless told: the log lines must stay on stderr
    (where the bar is), or a script's piped stdout fills with them."""
    main, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    process = subprocess.Popen(
        [sys.executable, PROGRAM, "--epochs", "2", "--samples", "9600", "--log-interval", "5",
         f"run.output_dir={tmp_path}", "tracking.enabled=false"],
        cwd=REPO, env=clean_environ(**EVERY_MOVE), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=secondary, text=True,
    )  # fmt: skip
    os.close(secondary)
    terminal = read_terminal(main)
    stdout, _ = process.communicate(timeout=120)
    assert process.returncode == 0, terminal[-3000:]
    assert "INFO checkpoint (end of training)" in terminal
    assert "INFO" not in stdout and stdout.startswith("RESULT "), stdout[-2000:]
