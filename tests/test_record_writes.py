"""Rank 0's record is written off the training thread: a file system that does not answer
holds back the record, never the step. A named pipe stands for that file system: a write to
it waits until someone reads, as a write to a hung mount waits."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from hpc_ddp.runtime.tracking.background import BackgroundWrites
from hpc_ddp.runtime.tracking.base import NullTracker
from hpc_ddp.runtime.tracking.journal import JournalTracker
from hpc_ddp.runtime.tracking.record import read_status

#: How long a call that must not wait for the file system is given before the test says it
#: did wait (it returns at once when right; it never returns when wrong).
NEVER_S = 60.0


class Recording(NullTracker):
    """MLflow's place: the points handed on."""

    def __init__(self) -> None:
        self.handed_on: list[tuple[dict[str, float], int]] = []

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.handed_on.append((dict(metrics), step))


def returns_without_waiting(call: Callable[[], None]) -> bool:
    returned = threading.Event()

    def target() -> None:
        call()
        returned.set()

    threading.Thread(target=target, daemon=True).start()
    return returned.wait(NEVER_S)


def test_a_file_system_that_does_not_answer_holds_back_the_record_not_the_training(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "name" / "id"
    position = [0, 0]
    inner = Recording()
    journal = JournalTracker(inner, run_dir, lambda: (position[0], position[1]), "7", 2)
    os.mkfifo(run_dir / "metrics.jsonl")
    position[:] = [5, 1]

    assert returns_without_waiting(lambda: journal.log_metrics({"loss": 0.5}, 5)), (
        f"log_metrics did not return within {NEVER_S:.0f} s: it waited for the file system"
    )
    assert inner.handed_on == [], "MLflow gets a point only once metrics.jsonl holds it"
    assert read_status(run_dir)["global_step"] == 0, "status.json waits behind the line"  # type: ignore[index]

    # The mount answers again: the line arrives whole, then everything queued behind it.
    with open(run_dir / "metrics.jsonl") as reader:
        lines = [json.loads(line) for line in reader.read().splitlines()]
    assert [(line.get("attempt"), line.get("from_step")) for line in lines[:1]] == [(1, 0)]
    assert (lines[1]["step"], lines[1]["global_step"], lines[1]["metrics"]) == (5, 5, {"loss": 0.5})
    journal.flush()
    assert inner.handed_on == [({"loss": 0.5}, 5)]
    assert read_status(run_dir)["global_step"] == 5  # type: ignore[index]


def test_the_end_waits_for_the_record_only_so_long_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "name" / "id"
    journal = JournalTracker(NullTracker(), run_dir, lambda: (3, 0), "7", 1, settle_limit_s=0.2)
    os.mkfifo(run_dir / "metrics.jsonl")  # nobody reads: the write can never finish
    assert returns_without_waiting(lambda: journal.log_metrics({"loss": 0.5}, 3))
    with caplog.at_level(logging.WARNING, logger="hpc_ddp"):
        assert returns_without_waiting(lambda: journal.finish("FINISHED"))
    said = [record.message for record in caplog.records if "not written within" in record.message]
    assert len(said) == 1 and str(run_dir) in said[0] and "HINT: " in said[0], said
    with open(run_dir / "metrics.jsonl") as reader:  # lets the writer go
        assert json.loads(reader.read().splitlines()[-1])["metrics"] == {"loss": 0.5}
    journal.flush()
    assert read_status(run_dir)["state"] == "finished"  # type: ignore[index]


def test_a_write_that_fails_is_said_and_the_writes_after_it_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    writes = BackgroundWrites()
    done: list[int] = []

    def broken() -> None:
        raise ValueError("no such value")

    with caplog.at_level(logging.WARNING, logger="hpc_ddp"):
        writes.submit(lambda: done.append(1))
        writes.submit(broken)
        writes.submit(lambda: done.append(3))
        assert writes.drain(NEVER_S), "the writes did not end"
    assert done == [1, 3]
    assert [r.message for r in caplog.records] == [
        "a write of the run's record failed: ValueError: no such value"
    ]
