"""Ctrl-C in a terminal, as a person presses it: the launcher runs on a real pty in a session
of its own, and SIGINT goes to its whole process group, as a terminal sends it. The first
Ctrl-C is a stop the ranks agree on (a checkpoint, then "to continue: ..."), a rerun goes on
from it in the same MLflow run; a second Ctrl-C aborts at once."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from hpc_ddp.runtime.errors import EXIT_STOPPED
from hpc_ddp.runtime.tracking.base import default_tracking_uri
from tests.helpers import REPO, clean_environ, run_local_program, signal_after

pytestmark = pytest.mark.e2e  # every test here starts processes

LM = str(REPO / "tests" / "programs" / "lm_loop.py")


class Terminal:
    """A command on a pty in its own session, its output collected as it comes."""

    def __init__(self, command: list[str], **environ: str) -> None:
        main, tty = pty.openpty()
        # A terminal 120 columns wide (a fresh pty has none, and a progress bar draws nothing).
        fcntl.ioctl(tty, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        self.process = subprocess.Popen(
            command,
            cwd=REPO,
            env=clean_environ(**environ),
            stdin=tty,
            stdout=tty,
            stderr=tty,
            start_new_session=True,
        )
        os.close(tty)
        self._main = main
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self._main, 4096)
            except OSError:
                return
            if not chunk:
                return
            self._chunks.append(chunk)

    @property
    def text(self) -> str:
        return b"".join(self._chunks).decode(errors="replace").replace("\r", "")

    def wait_for(self, pattern: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text):
            assert time.monotonic() < deadline, f"{pattern!r} not seen:\n{self.text[-3000:]}"
            assert self.process.poll() is None, f"ended early:\n{self.text[-3000:]}"
            time.sleep(0.05)

    def ctrl_c(self) -> None:
        """SIGINT to the foreground process group, as the terminal sends it."""
        os.killpg(self.process.pid, signal.SIGINT)

    def finish(self, timeout: float = 120) -> int:
        code = self.process.wait(timeout=timeout)
        self._reader.join(timeout=5)
        os.close(self._main)
        return code


def local(nproc: int, *arguments: str) -> list[str]:
    return [sys.executable, "-m", "hpc_ddp", "local", "--nproc", str(nproc), *arguments]


def test_ctrl_c_stops_with_a_checkpoint_and_a_rerun_continues_in_the_same_mlflow_run(
    tmp_path: Path,
) -> None:
    program = [LM, "--max-iters", "300", f"run.output_dir={tmp_path}"]
    held = ["--hold-at-step", "60", "run.id=ctrl-c", "preempt.check_every_steps=1"]
    terminal = Terminal(local(2, *program, *held))
    # The ranks hold after step 60 until the Ctrl-C reached them: it lands at step 61.
    terminal.wait_for(r"HOLDING at step 60 \(rank 0\)")
    terminal.ctrl_c()
    assert terminal.finish() == EXIT_STOPPED, terminal.text[-3000:]
    text = terminal.text
    stop = int(re.search(r"checkpoint \(stop signal\) step (\d+)", text).group(1))  # type: ignore[union-attr]
    assert stop == 61
    assert "Ctrl-C: stopping with a checkpoint at the ranks' next agreed check" in text
    assert "to continue, run the same command with run.id=ctrl-c" in text
    assert "Traceback" not in text and "interrupted" not in text

    rerun = subprocess.run(
        local(2, *program, "run.id=ctrl-c"),
        cwd=REPO,
        env=clean_environ(),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"at step {stop} " in rerun.stderr
    summary = json.loads(next(tmp_path.glob("lm_loop/ctrl-c/summary.json")).read_text())
    assert summary["global_step"] == 300 and summary["resumed_from_step"] == stop
    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path))
    experiment = client.get_experiment_by_name("hpc_ddp")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert [run.info.run_id for run in runs] == [summary["mlflow_run_id"]], "one MLflow run"
    assert runs[0].info.status == "FINISHED"
    assert runs[0].data.tags["hpc_ddp.attempt.0.end"] == "killed"


def test_a_second_ctrl_c_aborts_at_once(tmp_path: Path) -> None:
    """The ranks hold after step 10 for two stop signals: the first Ctrl-C's stop is still
    waiting for the step to end when the second one comes."""
    program = [LM, "--max-iters", "50", "--log-interval", "1", f"run.output_dir={tmp_path}"]
    held = ["--hold-at-step", "10", "--hold-signals", "2", "preempt.check_every_steps=1"]
    terminal = Terminal(local(2, *program, *held, "tracking.enabled=false"))
    terminal.wait_for(r"HOLDING at step 10 \(rank 0\)")
    terminal.ctrl_c()
    # Rank 0 says so once the launcher passed the first on: the second is not merged into it.
    terminal.wait_for(r"Ctrl-C: stopping with a checkpoint at the ranks' next agreed check")
    terminal.wait_for(r"HELD for a second stop signal \(rank 0\)")
    terminal.ctrl_c()
    code = terminal.finish(timeout=60)
    assert code == 130, terminal.text[-3000:]
    assert "interrupted" in terminal.text
    assert not list(tmp_path.glob("lm_loop/*/checkpoints/step-*")), "aborted: no checkpoint"


def ignore_ctrl_c() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_a_launcher_started_with_ctrl_c_ignored_still_passes_it_on_as_a_stop(
    tmp_path: Path,
) -> None:
    """A script's background job (`hpc-ddp local ... &`) starts with SIGINT ignored, and so
    did every rank once: `kill -INT` on the launcher, which takes it as a stop, then reached
    ranks that ignored it, and the run trained on (and a test runner started that way failed
    every Ctrl-C test). The ranks now start with Ctrl-C at its default."""
    program = [LM, "--max-iters", "300", f"run.output_dir={tmp_path}", "tracking.enabled=false"]
    held = ["--hold-at-step", "30", "run.id=background", "preempt.check_every_steps=1"]
    process = subprocess.Popen(
        local(2, *program, *held),
        cwd=REPO,
        env=clean_environ(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ignore_ctrl_c,
    )
    log = signal_after(process, r"HOLDING at step 30 \(rank 0\)", signal.SIGINT)
    assert process.returncode == EXIT_STOPPED, log[-3000:]
    assert "checkpoint (stop signal) step 31:" in log, log[-3000:]
    assert "to continue, run the same command with run.id=background" in log


TWO_RANKS_PRINTING = """
import os
rank = os.environ["RANK"]
for i in range(300):
    print(f"PLAIN rank={rank} line {i}", "x" * 40)
"""


def test_the_ranks_printed_lines_reach_the_terminal_whole_and_labelled(tmp_path: Path) -> None:
    """Unbuffered output (PYTHONUNBUFFERED, as many clusters set it) writes a print's text
    and its newline separately; the lines still arrive whole, each after its rank. (A
    partial line flushed on purpose goes out at once: tests/test_loop_parts.py.)"""
    script = tmp_path / "two.py"
    script.write_text(TWO_RANKS_PRINTING)
    terminal = Terminal(local(2, str(script)), PYTHONUNBUFFERED="1")
    assert terminal.finish() == 0, terminal.text[-3000:]
    lines = [line for line in terminal.text.splitlines() if "PLAIN" in line]
    pattern = re.compile(r"\[rank (\d)\] PLAIN rank=\1 line \d+ x{40}")
    assert [line for line in lines if not pattern.fullmatch(line)] == []
    assert len(lines) == 600


def test_long_lines_from_four_ranks_at_once_arrive_whole_through_a_pipe(tmp_path: Path) -> None:
    """100 KB lines, printed by 4 ranks at the same moment into one pipe: a pipe takes a write
    whole only up to 4 KB (and holds 64 KB), so the ranks take turns (a lock file the
    launcher makes)."""
    (tmp_path / "barrier").mkdir()
    program = [str(REPO / "tests" / "programs" / "long_lines.py"), str(tmp_path / "barrier")]
    result = run_local_program(4, [*program, "10", "100000"])
    assert result.returncode == 0, result.stderr[-3000:]
    pattern = re.compile(r"R(\d)-(\d+):(\d)+:END\1-\2")
    lines = result.stdout.splitlines()
    cut = [line[:80] for line in lines if not pattern.fullmatch(line)]
    assert cut == [] and len(lines) == 40, f"{len(cut)} lines cut into others: {cut[:4]}"
    for rank in range(4):
        own = [line for line in lines if line.startswith(f"R{rank}-")]
        assert own == [f"R{rank}-{i}:{str(rank) * 100000}:END{rank}-{i}" for i in range(10)]
