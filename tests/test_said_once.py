"""An error every rank meets alike, said by one rank of each host: its first rank says it
and leaves a mark, the others wait for the mark (an injected clock; no process is started)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.exits import report_failure
from hpc_ddp.runtime.said_once import SAID_WAIT_S, mark_path, say_once
from tests.helpers import HandClock


def waited_on(clock: HandClock) -> Callable[[float], None]:
    def wait(seconds: float) -> None:
        clock.now += seconds

    return wait


def saying(said: list[str], what: str) -> Callable[[], None]:
    return lambda: said.append(what)


def test_the_hosts_first_rank_says_it_and_the_others_end_quietly_once_it_is_said(
    tmp_path: Path,
) -> None:
    said: list[str] = []
    mark = tmp_path / "mark"
    clock = HandClock(0.0)
    assert say_once(saying(said, "first"), saying(said, "late"), mark, True)
    assert mark.exists()
    later = say_once(saying(said, "second"), saying(said, "late"), mark, False, clock,
                     waited_on(clock))  # fmt: skip
    assert not later and said == ["first"] and clock.now == 0.0, "said already: no wait"


def test_a_first_rank_says_it_even_where_an_earlier_mark_is_left(tmp_path: Path) -> None:
    """Plain `python train.py` run again and again from one `srun --pty bash` (whose
    SLURM_LOCALID is 0) says its error every time."""
    mark = tmp_path / "mark"
    said: list[str] = []
    for _run in range(2):
        assert say_once(saying(said, "again"), saying(said, "late"), mark, True)
    assert said == ["again", "again"]


def test_a_mark_that_never_comes_is_waited_for_then_said_late(tmp_path: Path) -> None:
    """The host's first rank was killed before it could say it: nothing is lost."""
    said: list[str] = []
    clock = HandClock(0.0)
    assert say_once(saying(said, "first"), saying(said, "late"), tmp_path / "mark", False,
                    clock, waited_on(clock))  # fmt: skip
    assert said == ["late"] and clock.now >= SAID_WAIT_S


def test_without_a_mark_or_a_folder_to_write_in_it_is_still_said(tmp_path: Path) -> None:
    said: list[str] = []
    assert say_once(saying(said, "no mark"), saying(said, "late"), None, False)
    assert say_once(saying(said, "no folder"), saying(said, "late"), tmp_path / "no" / "m", True)
    assert said == ["no mark", "no folder"]


def test_a_link_in_the_marks_place_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "someone's file"
    target.write_text("kept\n")
    mark = tmp_path / "mark"
    mark.symlink_to(target)
    assert say_once(lambda: None, lambda: None, mark, True)
    assert target.read_text() == "kept\n"


def test_the_mark_names_the_host_the_launch_and_the_message(tmp_path: Path) -> None:
    local = {"LOCAL_RANK": "1", "MASTER_PORT": "29500", "HPC_DDP_LOCAL_RUN_ID": "r1"}
    mine = mark_path(tmp_path, "node1", local, "bad setting")
    assert mine.parent == tmp_path and mine.name.startswith(f"hpc_ddp-said-{os.getuid()}-")
    assert mark_path(tmp_path, "node1", {**local, "LOCAL_RANK": "0"}, "bad setting") == mine
    others = [
        mark_path(tmp_path, "node2", local, "bad setting"),
        mark_path(tmp_path, "node1", local, "another"),
        mark_path(tmp_path, "node1", {**local, "MASTER_PORT": "29501"}, "bad setting"),
        mark_path(tmp_path, "node1", {**local, "TORCHELASTIC_RESTART_COUNT": "1"}, "bad setting"),
        mark_path(tmp_path, "node1", {**local, "SLURM_STEP_ID": "1"}, "bad setting"),
    ]
    assert mine not in others and len(set(others)) == len(others)


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
