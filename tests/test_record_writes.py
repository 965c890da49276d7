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
from hpc_ddp.runtime.tracking.record import (
    mlflow_behind,
    read_earlier_metrics,
    read_status,
    read_tags_set,
)
from hpc_ddp.runtime.tracking.sync import remember_run

#: How long a call that must not wait for the file system is given before the test says it
#: did wait (it returns at once when right; it never returns when wrong).
NEVER_S = 60.0


class Recording(NullTracker):
    """MLflow's place: the calls handed on, in order."""

    def __init__(self) -> None:
        self.handed_on: list[tuple[object, ...]] = []

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.handed_on.append(("log_metrics", dict(metrics), step))

    def log_text_artifact(self, name: str, text: str) -> None:
        self.handed_on.append(("log_text_artifact", name))

    def log_json_artifact(self, name: str, data: object) -> None:
        self.handed_on.append(("log_json_artifact", name, data))

    def finish(self, status: str) -> None:
        self.handed_on.append(("finish", status))

    def set_tag(self, key: str, value: str) -> None:
        self.handed_on.append(("set_tag", key, value))


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
    journal.log_text_artifact("config.yaml", "lr: 0.1\n")
    assert inner.handed_on == [], "MLflow gets a point only once metrics.jsonl holds it"
    assert read_status(run_dir)["global_step"] == 0, "status.json waits behind the line"  # type: ignore[index]

    # The mount answers again: the line arrives whole, then everything queued behind it.
    with open(run_dir / "metrics.jsonl") as reader:
        lines = [json.loads(line) for line in reader.read().splitlines()]
    assert [(line.get("attempt"), line.get("from_step")) for line in lines[:1]] == [(1, 0)]
    assert (lines[1]["step"], lines[1]["global_step"], lines[1]["metrics"]) == (5, 5, {"loss": 0.5})
    journal.flush()
    assert inner.handed_on == [
        ("log_metrics", {"loss": 0.5}, 5),
        ("log_text_artifact", "config.yaml"),
    ], "the calls reach MLflow in the order they were made"
    assert read_status(run_dir)["global_step"] == 5  # type: ignore[index]


def test_the_end_waits_for_the_record_only_so_long_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "name" / "id"
    run_dir.mkdir(parents=True)  # the start's own writes may outlast the short limit
    inner = Recording()
    journal = JournalTracker(inner, run_dir, lambda: (3, 0), "7", 1, settle_limit_s=0.2)
    os.mkfifo(run_dir / "metrics.jsonl")  # nobody reads: the write can never finish
    assert returns_without_waiting(lambda: journal.log_metrics({"loss": 0.5}, 3))
    with caplog.at_level(logging.WARNING, logger="hpc_ddp"):
        assert returns_without_waiting(lambda: journal.finish("FINISHED"))
    said = [record.message for record in caplog.records if "not written within" in record.message]
    assert len(said) == 1 and str(run_dir) in said[0] and "HINT: " in said[0], said
    with open(run_dir / "metrics.jsonl") as reader:  # lets the writer go
        assert json.loads(reader.read().splitlines()[-1])["metrics"] == {"loss": 0.5}
    journal.flush()
    status = read_status(run_dir)
    assert status is not None and status["state"] == "finished"
    assert inner.handed_on == [("finish", "FINISHED")], (
        "MLflow's run ended at the limit; the point that was still waiting is not sent after it"
    )
    assert status["tracking"].startswith("behind: ") and mlflow_behind(status), (
        "the next attempt replays the point MLflow never got"
    )


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


def test_the_wait_of_the_oldest_write_is_known_while_it_waits() -> None:
    now = [100.0]
    writes = BackgroundWrites(name="record-test-clock", clock=lambda: now[0])
    release = threading.Event()
    writes.submit(lambda: None)
    assert writes.drain(NEVER_S) and writes.waiting_s() == 0.0

    def held() -> None:
        release.wait()

    writes.submit(held)
    now[0] = 130.5
    assert writes.waiting_s() == 30.5
    release.set()
    assert writes.drain(NEVER_S) and writes.waiting_s() == 0.0


def test_an_idle_writer_thread_ends_and_a_later_write_starts_another() -> None:
    """A process that runs many runs keeps no thread (and no tracker) per finished run."""
    writes = BackgroundWrites(name="record-test-idle", idle_exit_s=0.01)
    writers: list[threading.Thread] = []
    for _ in range(2):
        writes.submit(lambda: writers.append(threading.current_thread()))
        assert writes.drain(NEVER_S)
        writers[-1].join(NEVER_S)
        assert not writers[-1].is_alive(), (
            f"the idle writer thread did not end within {NEVER_S:.0f} s"
        )
    assert writers[0] is not writers[1], "the second write had a thread of its own"


@pytest.mark.e2e
def test_a_child_forked_from_rank_0_does_not_wait_for_its_parents_writes(tmp_path: Path) -> None:
    """A user's helper forked while a write is held up exits at once: the writes, and the
    thread that makes them, are the parent's."""
    from hpc_ddp.runtime.tracking import background

    run_dir = tmp_path / "name" / "id"
    journal = JournalTracker(NullTracker(), run_dir, lambda: (3, 0), "7", 1)
    os.mkfifo(run_dir / "metrics.jsonl")
    assert returns_without_waiting(lambda: journal.log_metrics({"loss": 0.5}, 3))
    reading, writing = os.pipe()
    child = os.fork()
    if child == 0:  # the child: say how many writers its exit would wait for
        os.write(writing, str(len(background._LIVE)).encode())
        os._exit(0)
    os.close(writing)
    said = os.read(reading, 16).decode()
    os.waitpid(child, 0)
    os.close(reading)
    with open(run_dir / "metrics.jsonl") as pipe:  # lets the parent's writer go
        pipe.read()
    assert journal.flush()
    assert said == "0", f"the forked child would wait at exit for {said} writers of its parent"


def test_a_step_from_numpy_or_a_tensor_is_a_whole_number_json_can_hold() -> None:
    """Before, ``run.log_metrics(values, step=np.int64(3))`` ended in a TypeError from the
    record's JSON; a fractional step went through to MLflow."""
    import numpy as np
    import torch

    from hpc_ddp.runtime.errors import HpcDdpError
    from hpc_ddp.runtime.loop.logged import logged_step

    steps = [logged_step(step) for step in (np.int64(3), torch.tensor(4), 5)]
    assert steps == [3, 4, 5] and json.dumps(steps) == "[3, 4, 5]"
    for wrong in (1.5, True, -1, torch.tensor(1.5), "3"):
        with pytest.raises(HpcDdpError, match="the step must be a whole number of 0 or more"):
            logged_step(wrong)


def test_a_json_artifact_is_sent_as_it_was_when_logged(tmp_path: Path) -> None:
    """The end's summary gains a field for the file after it is handed over; MLflow's copy
    must not."""
    inner = Recording()
    journal = JournalTracker(inner, tmp_path / "name" / "id", lambda: (3, 0), "7", 1)
    summary: dict[str, object] = {"loss": 1.0}
    journal.log_json_artifact("summary.json", summary)
    summary["summary_path"] = "runs/name/id/summary.json"
    journal.finish("FINISHED")
    assert inner.handed_on == [
        ("log_json_artifact", "summary.json", {"loss": 1.0}),
        ("finish", "FINISHED"),
    ]


def test_a_tag_set_is_kept_in_the_record_over_the_attempts(tmp_path: Path) -> None:
    """A tag set while MLflow was away reaches it with the run's recovery or its sync (which
    read tracking.json), or the next attempt's opening of MLflow (which reads it too)."""
    run_dir = tmp_path / "name" / "id"
    tracking = {"uri": "sqlite:///x.db", "tags": {"hpc_ddp.world_size": "2"}}
    first = Recording()
    journal = JournalTracker(first, run_dir, lambda: (5, 0), "7", 2, tracking)
    journal.set_tag("hpc_ddp.idle_gpus", "node1 GPU 1 (rank 1)")
    journal.flush()
    assert first.handed_on == [("set_tag", "hpc_ddp.idle_gpus", "node1 GPU 1 (rank 1)")]
    record = json.loads((run_dir / "tracking.json").read_text())
    assert record["tags_set"] == {"hpc_ddp.idle_gpus": "node1 GPU 1 (rank 1)"}
    assert record["tags"] == {"hpc_ddp.world_size": "2"}, "the run's own tags are left as they were"
    assert read_tags_set(run_dir) == record["tags_set"]

    second = Recording()
    JournalTracker(second, run_dir, lambda: (5, 0), "8", 2, tracking).flush()
    assert second.handed_on == [], "nothing reaches MLflow before the run has a call for it"
    assert read_tags_set(run_dir) == record["tags_set"], "kept for a sync of this attempt"


def test_a_sync_keeps_what_the_run_added_to_its_record_since_the_sync_read_it(
    tmp_path: Path,
) -> None:
    """A running run's recovery read tracking.json, then the idle-GPU alarm tagged the run;
    the recovery's new MLflow run id goes into the record as it is now, the tag kept."""
    record = tmp_path / "tracking.json"
    read_by_the_sync = {"uri": "sqlite:///mlflow.db", "experiment": "e", "run_id": "old"}
    record.write_text(json.dumps({**read_by_the_sync, "tags_set": {"hpc_ddp.idle_gpus": "a"}}))
    remember_run(tmp_path, read_by_the_sync, "sqlite:///mlflow.db", "new")
    assert json.loads(record.read_text()) == {
        **read_by_the_sync,
        "run_id": "new",
        "tags_set": {"hpc_ddp.idle_gpus": "a"},
    }


class Tracking(Recording):
    """MLflow that took every call."""

    status = "ok"

    def suspend(self) -> None:
        self.handed_on.append(("suspend",))


class Failing(Tracking):
    """MLflow that failed during the attempt (GuardedTracker's status then)."""

    status = "failed: suspending the run: no answer within 30 s"


@pytest.mark.parametrize(
    ("inner", "behind"),
    [(Tracking(), False), (Recording(), True), (Failing(), True)],
    ids=["ok", "off", "failed"],
)
def test_an_attempt_leaves_what_became_of_its_tracking_for_the_next(
    tmp_path: Path, inner: Recording, behind: bool
) -> None:
    """The next attempt replays what this one left out of MLflow when its tracking failed
    (or was off), not when it took every call; an attempt killed outright says nothing,
    which counts as behind too."""
    run_dir = tmp_path / "name" / "id"
    journal = JournalTracker(inner, run_dir, lambda: (5, 0), "7", 2)
    assert mlflow_behind(read_status(run_dir)) is True, "running: nothing said yet"
    journal.suspend()
    status = read_status(run_dir)
    assert status is not None and status["state"] == "requeued"
    assert status["tracking"] == inner.status
    assert mlflow_behind(status) is behind


def test_only_a_new_run_or_tracking_that_ended_whole_leaves_mlflow_up_to_date() -> None:
    assert mlflow_behind(None) is False and mlflow_behind({}) is False
    assert mlflow_behind({"state": "requeued", "tracking": "ok"}) is False
    assert mlflow_behind({"state": "stopped", "tracking": "recovered after: x"}) is False
    assert mlflow_behind({"state": "running"}) is True, "killed outright"
    assert mlflow_behind({"state": "stopped", "tracking": "failed: could not start"}) is True
    assert mlflow_behind({"state": "requeued", "tracking": "off"}) is True


def test_a_catch_up_takes_the_earlier_attempts_points_up_to_the_resume(tmp_path: Path) -> None:
    """Attempt 1 logged steps 10 to 40 and was killed; attempt 2 (begun at t=100) resumed
    from its checkpoint at step 20 and logged step 30 again before its MLflow caught up.
    The catch-up replays what the run's final history holds of attempt 1: steps 10 and 20,
    not its 30 and 40 (computed again), nor attempt 2's own 30 (sent by attempt 2)."""
    lines = [
        {"attempt": 1, "from_step": 0, "time": 1.0},
        *(
            {"step": step, "time": 1.0 + step, "metrics": {"loss": step / 10}}
            for step in (10, 20, 30, 40)
        ),
        {"attempt": 2, "from_step": 20, "time": 101.0},
        {"step": 30, "time": 101.0, "metrics": {"loss": 9.0}},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    earlier = read_earlier_metrics(tmp_path, 100.0, 20)
    assert [(entry["step"], entry["metrics"]) for entry in earlier] == [
        (10, {"loss": 1.0}),
        (20, {"loss": 2.0}),
    ]
    assert read_earlier_metrics(tmp_path / "none", 100.0, 20) == []
