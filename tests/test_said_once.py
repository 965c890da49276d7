"""An error every rank meets alike, said by one rank of each host: its first rank says it
and leaves a mark, the others wait for the mark (an injected clock; no process is started)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.exits import report_failure
from hpc_ddp.runtime.said_once import SAID_WAIT_S, say_once, siblings_mark
from tests.helpers import HandClock


def waited_on(clock: HandClock) -> Callable[[float], None]:
    def wait(seconds: float) -> None:
        clock.now += seconds

    return wait


def test_the_hosts_first_rank_says_it_and_the_others_end_quietly_once_it_is_said(
    tmp_path: Path,
) -> None:
    said: list[str] = []
    mark = tmp_path / "mark"
    clock = HandClock(0.0)
    assert say_once(lambda: said.append("first"), mark, True)
    assert mark.exists()
    assert not say_once(lambda: said.append("second"), mark, False, clock, waited_on(clock))
    assert said == ["first"] and clock.now == 0.0, "it was said already: no wait"


def test_a_first_rank_says_it_even_where_an_earlier_mark_is_left(tmp_path: Path) -> None:
    """Plain `python train.py` run again and again from one `srun --pty bash` (whose
    SLURM_LOCALID is 0) says its error every time."""
    mark = tmp_path / "mark"
    said: list[str] = []
    for _run in range(2):
        assert say_once(lambda: said.append("again"), mark, True)
    assert said == ["again", "again"]


def test_a_mark_that_never_comes_is_waited_for_then_said(tmp_path: Path) -> None:
    """The host's first rank was killed before it could say it: nothing is lost."""
    said: list[str] = []
    clock = HandClock(0.0)
    assert say_once(lambda: said.append("late"), tmp_path / "mark", False, clock, waited_on(clock))
    assert said == ["late"] and clock.now >= SAID_WAIT_S


def test_without_a_mark_or_a_folder_to_write_in_it_is_still_said(tmp_path: Path) -> None:
    said: list[str] = []
    assert say_once(lambda: said.append("no mark"), None, False)
    assert say_once(lambda: said.append("no folder"), tmp_path / "missing" / "mark", True)
    assert said == ["no mark", "no folder"]


def test_the_mark_names_the_parent_the_launch_and_the_message(tmp_path: Path) -> None:
    local = {"LOCAL_RANK": "1", "MASTER_PORT": "29500"}
    mine = siblings_mark(tmp_path, os.getpid(), local, "bad setting")
    assert mine is not None and mine.parent == tmp_path
    assert mine.name.startswith(f"hpc_ddp-said-{os.getuid()}-")
    assert siblings_mark(tmp_path, os.getpid(), {**local, "LOCAL_RANK": "0"}, "bad setting") == mine
    assert siblings_mark(tmp_path, os.getpid(), local, "another") != mine, "another message"
    again = {**local, "MASTER_PORT": "29501"}
    assert siblings_mark(tmp_path, os.getpid(), again, "bad setting") != mine, "a later launch"
    restarted = {**local, "TORCHELASTIC_RESTART_COUNT": "1"}
    assert siblings_mark(tmp_path, os.getpid(), restarted, "bad setting") != mine
    slurm = {"SLURM_LOCALID": "3", "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}
    assert siblings_mark(tmp_path, os.getpid(), slurm, "bad setting") is not None
    assert siblings_mark(tmp_path, os.getpid(), {"MASTER_PORT": "1"}, "x") is None, "no launcher"
    beyond_any_pid = 4_194_305  # Linux's PID_MAX_LIMIT + 1
    assert siblings_mark(tmp_path, beyond_any_pid, local, "x") is None, "no such process"


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_only_an_error_the_same_on_every_rank_is_said_once(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    local_rank: str,
) -> None:
    """The host's first rank says it every time; another rank, once its first has said it,
    not at all."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert report_failure(HpcDdpError("bad setting", "fix it", 2, True), "0") == 2
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    for _rank in range(2):
        assert report_failure(HpcDdpError("bad setting", "fix it", 2, True), "1") == 2
        assert report_failure(HpcDdpError("this rank's own", "fix it"), "1") == 2
    printed = capsys.readouterr().err
    assert printed.count("bad setting") == (3 if local_rank == "0" else 1)
    assert printed.count("this rank's own") == 2
