"""What ended each attempt that failed, on record: every rank adds what ended it to the
run's failures.jsonl (the error in one line, the line of the user's code it came through),
and `hpc-ddp runs NAME/ID` names, per failed attempt, the rank whose error came first, not
the ranks that only lost contact with it."""

from __future__ import annotations

import json
import re
import sysconfig
from pathlib import Path

import pytest
import torch

import hpc_ddp
from hpc_ddp.runtime.errors import EXIT_FAILURE, HpcDdpError
from hpc_ddp.runtime.exits import failure_record, innermost_user_frame, report_failure
from hpc_ddp.runtime.preempt.progress import (
    FAILURES,
    attempt_of,
    failure_lines,
    read_failures,
    record_failure,
)


def check_label(label: int) -> None:
    if label > 9:
        raise ValueError(f"bad label {label}\nin batch 7")


def test_a_users_error_is_kept_in_one_line_with_the_line_of_their_code() -> None:
    with pytest.raises(ValueError) as caught:
        check_label(12)
    record = failure_record(caught.value)
    assert record["error"] == "ValueError: bad label 12"
    raised_at = check_label.__code__.co_firstlineno + 2
    assert record["at"] == f"{__file__}:{raised_at} in check_label"
    assert record["follows_another_rank"] is False


def read_config(text: str) -> object:
    return json.loads(text)


def test_an_error_inside_an_installed_library_is_placed_at_the_users_call() -> None:
    with pytest.raises(ValueError) as caught:
        read_config("{")  # json's frames are the standard library's
    called_at = read_config.__code__.co_firstlineno + 1
    assert failure_record(caught.value)["at"] == f"{__file__}:{called_at} in read_config"


TORCH_FILE = str(Path(torch.__file__).parent / "nn" / "parallel" / "distributed.py")
TOOLKIT_FILE = str(Path(hpc_ddp.__file__).parent / "runtime" / "loop" / "steps.py")
STDLIB_FILE = str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py")
INSTALLED = Path(sysconfig.get_paths()["purelib"])


@pytest.mark.parametrize(
    ("files", "users"),
    [
        # innermost first: torch's and hpc_ddp's frames below the script's
        ([TORCH_FILE, TOOLKIT_FILE, "/home/u/train.py", "/home/u/main.py"], 2),
        # a library the script calls is not the script
        ([str(INSTALLED / "transformers" / "trainer.py"), "/home/u/train.py"], 1),
        # the interpreter's own frames are never the user's file
        (["<frozen importlib._bootstrap>", "<string>", "/home/u/train.py"], 2),
        # a script installed as a package: its own frame, not the standard library's
        ([STDLIB_FILE, str(INSTALLED / "myproject" / "train.py"), TOOLKIT_FILE], 1),
        ([TORCH_FILE, TOOLKIT_FILE, STDLIB_FILE, "<frozen runpy>"], None),
    ],
    ids=["under-torch", "under-a-library", "frozen", "installed-script", "none"],
)
def test_the_users_frame_is_the_innermost_outside_the_toolkit_torch_and_libraries(
    files: list[str], users: int | None
) -> None:
    assert innermost_user_frame(files) == users


class UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("the user's __str__ failed")


def raise_unprintable() -> None:
    raise UnprintableError()


def test_an_error_whose_message_cannot_be_read_is_recorded_by_its_type(
    capsys: pytest.CaptureFixture[str],
) -> None:
    try:
        raise_unprintable()
    except UnprintableError as error:
        record = failure_record(error)
        assert report_failure(error, "3") == EXIT_FAILURE
    raised_at = raise_unprintable.__code__.co_firstlineno + 1
    assert "[rank 3] failed:" in capsys.readouterr().err
    assert record == {
        "error": "UnprintableError",
        "at": f"{__file__}:{raised_at} in raise_unprintable",
        "follows_another_rank": False,
    }


def test_a_lost_peer_follows_another_rank_and_a_toolkit_error_says_its_message() -> None:
    gone = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:50410")
    assert failure_record(gone) == {
        "error": "another rank went away during a collective",
        "at": None,
        "follows_another_rank": True,
    }
    refused = failure_record(HpcDdpError("batch 63 does not divide over 2 ranks", "use 64"))
    assert refused["error"] == "HpcDdpError: batch 63 does not divide over 2 ranks"


ATTEMPTS = [
    {"job": "77", "restart_count": 0, "start_unix": 100.0, "end_unix": 200.0, "status": "stopped"},
    {"job": "77", "restart_count": 1, "start_unix": 300.0, "end_unix": 400.0, "status": "failed"},
]


@pytest.mark.parametrize(
    ("failure", "attempt"),
    [
        ({"time": 150.0, "restart_count": 0}, 1),
        ({"time": 399.0, "restart_count": 1}, 2),
        ({"time": 405.0, "restart_count": 1}, 2),
        ({"time": 500.0, "restart_count": 1}, None),
        ({"time": 500.0, "restart_count": 1, "follows_another_rank": True}, 2),
        ({"time": 250.0, "restart_count": 0}, None),
        ({"time": 250.0, "restart_count": 1}, None),
        ({"time": 50.0, "restart_count": 0}, None),
        ({"time": 350.0, "restart_count": 1, "job": "78"}, None),
    ],
    ids=[
        "in-the-first", "in-the-second", "just-after-its-end", "a-later-start-with-no-record",
        "a-lost-contact-said-late", "between-attempts", "before-its-restart-began",
        "before-any", "another-job",
    ],
)  # fmt: skip
def test_a_failure_belongs_to_its_jobs_attempt_running_then(
    failure: dict[str, object], attempt: int | None
) -> None:
    assert attempt_of(ATTEMPTS, {"job": "77", **failure}) == attempt


def test_the_first_rank_that_did_not_only_lose_contact_is_named(tmp_path: Path) -> None:
    where = {"host": "node2", "job": "77", "restart_count": 1}
    lost = {"error": "another rank went away during a collective", "at": "train.py:40 in main",
            "follows_another_rank": True, "step": 30}  # fmt: skip
    raised = {"error": "ValueError: bad label 12", "at": "train.py:25 in check_label",
              "follows_another_rank": False, "step": 30}  # fmt: skip
    record_failure(tmp_path, {**where, "rank": 0}, {**lost, "time": 380.0})
    record_failure(tmp_path, {**where, "rank": 1}, {**raised, "time": 380.5})  # a clock behind
    record_failure(tmp_path, {**where, "rank": 2}, {**lost, "time": 381.0})
    refused = {"error": "HpcDdpError: batch_size=15 does not divide", "step": 0}
    record_failure(tmp_path, {**where, "rank": [0]}, {**refused, "time": 900.0})  # damaged rank
    with (tmp_path / FAILURES).open("a") as record:
        record.write('{"torn')  # a writer killed mid-line
    failures = read_failures(tmp_path)
    assert [failure["rank"] for failure in failures] == [0, 1, 2, [0]]
    lines = failure_lines(ATTEMPTS, failures)
    assert lines[0] == (
        "attempt 2 failed at step 30: rank 1 on node2: ValueError: bad label 12, at "
        "train.py:25 in check_label; 2 other rank(s) ended after it"
    )
    assert re.fullmatch(
        r"a start at \S+ \S+ failed at step 0: rank \[0\] on node2: HpcDdpError: "
        r"batch_size=15 does not divide",
        lines[1],
    ), lines
    assert len(lines) == 2
    assert failure_lines(ATTEMPTS, []) == [] and read_failures(tmp_path / "none") == []


def test_ranks_killed_without_a_word_are_named_before_those_that_lost_them(
    tmp_path: Path,
) -> None:
    """A rank killed outright (SIGKILL, the out-of-memory killer, a lost host) writes no line;
    the ranks that lost contact with it do. Of an attempt whose lines all only lost contact,
    the ranks with no line are the likely cause."""
    four_ranks = [{**ATTEMPTS[0], "ranks": 4}]
    lost = {"host": "node1", "job": "77", "restart_count": 0, "step": 12,
            "error": "another rank went away during a collective", "at": "train.py:40 in main",
            "follows_another_rank": True}  # fmt: skip
    for rank in (0, 3):
        record_failure(tmp_path, {"rank": rank}, {**lost, "time": 150.0 + rank})
    assert failure_lines(four_ranks, read_failures(tmp_path)) == [
        "attempt 1 failed at step 12: ranks 1, 2 left no line (killed outright: by SIGKILL, "
        "the out-of-memory killer or with its host; or stopped before it could write; the "
        "job's log says which), then "
        "rank 0 on node1: another rank went away during a collective, at train.py:40 in main; "
        "1 other rank(s) ended after it"
    ]
    # One rank's own error names that rank: the silent ones followed it.
    record_failure(tmp_path, {"rank": 2}, {**lost, "follows_another_rank": False,
                                           "error": "stalled: ...", "time": 152.0})  # fmt: skip
    assert failure_lines(four_ranks, read_failures(tmp_path))[0].startswith(
        "attempt 1 failed at step 12: rank 2 on node1: stalled: ..."
    )
    # An attempt that does not say how many ranks it had names none.
    assert "left no line" not in failure_lines(ATTEMPTS, read_failures(tmp_path)[:1])[0]
