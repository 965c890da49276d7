"""An error every rank meets alike, said by one rank of each host: the claim and its mark,
driven with an injected clock (no process is started)."""

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


def test_the_first_to_claim_says_it_and_the_others_end_quietly_once_it_is_said(
    tmp_path: Path,
) -> None:
    said: list[str] = []
    mark = tmp_path / "mark"
    assert say_once(lambda: said.append("first"), mark)
    assert mark.read_text() == "said\n", "the claim holds the mark that it was said"
    clock = HandClock(0.0)
    assert not say_once(lambda: said.append("second"), mark, clock, waited_on(clock))
    assert said == ["first"] and clock.now == 0.0, "it was said already: no wait"


def test_a_claim_never_said_is_said_again_after_the_wait(tmp_path: Path) -> None:
    """The claiming rank was killed before it could say it: nothing is lost."""
    mark = tmp_path / "mark"
    mark.touch()  # claimed, not said
    said: list[str] = []
    clock = HandClock(0.0)
    assert say_once(lambda: said.append("late"), mark, clock, waited_on(clock))
    assert said == ["late"] and clock.now >= SAID_WAIT_S


def test_without_a_mark_or_a_folder_to_write_in_every_rank_says_it(tmp_path: Path) -> None:
    said: list[str] = []
    assert say_once(lambda: said.append("no mark"), None)
    assert say_once(lambda: said.append("no folder"), tmp_path / "missing" / "mark")
    assert said == ["no mark", "no folder"]


def test_the_mark_names_the_parent_by_its_pid_and_start_and_the_launch(tmp_path: Path) -> None:
    local = {"LOCAL_RANK": "1", "MASTER_PORT": "29500"}
    mine = siblings_mark(tmp_path, os.getpid(), local)
    assert mine is not None and mine.parent == tmp_path
    assert mine.name.startswith(f"hpc_ddp-said-{os.getuid()}-{os.getpid()}-")
    assert siblings_mark(tmp_path, os.getpid(), {**local, "LOCAL_RANK": "0"}) == mine
    again = {**local, "MASTER_PORT": "29501"}
    assert siblings_mark(tmp_path, os.getpid(), again) != mine, "a later launch by the parent"
    restarted = {**local, "TORCHELASTIC_RESTART_COUNT": "1"}
    assert siblings_mark(tmp_path, os.getpid(), restarted) != mine, "torchrun's restart"
    slurm = {"SLURM_LOCALID": "3", "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}
    assert siblings_mark(tmp_path, os.getpid(), slurm) is not None
    beyond_any_pid = 4_194_305  # Linux's PID_MAX_LIMIT + 1
    assert siblings_mark(tmp_path, beyond_any_pid, local) is None, "no such process: no mark"


def test_a_process_no_launcher_numbered_always_says_it(tmp_path: Path) -> None:
    """Plain `python train.py`, run again and again by one shell, has no siblings."""
    assert siblings_mark(tmp_path, os.getpid(), {"MASTER_PORT": "29500"}) is None


def test_only_an_error_the_same_on_every_rank_is_said_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    for _rank in range(3):
        assert report_failure(HpcDdpError("bad setting", "fix it", 2, True), "0") == 2
        assert report_failure(HpcDdpError("this rank's own", "fix it"), "0") == 2
    printed = capsys.readouterr().err
    assert printed.count("bad setting") == 1 and printed.count("this rank's own") == 3
