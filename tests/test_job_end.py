"""The stop before the job's end, in this process at world size 1: squeue's time left read,
the end kept current by re-reads (a clock and a reader of our own stand in for time and
squeue), the time a stop needs, and the stopper stopping on it with no signal. The real
job, with `scontrol update TimeLimit` while it runs, is in test_slurm_fault_tolerance.py."""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from pathlib import Path

import pytest

from hpc_ddp.runtime.checkpoint.files import checkpoint_dir, list_checkpoints
from hpc_ddp.runtime.config import PreemptConfig, RunConfig, RuntimeConfig
from hpc_ddp.runtime.errors import HpcDdpError, Stopped
from hpc_ddp.runtime.loop.checkpointer import Checkpointer
from hpc_ddp.runtime.loop.context import RunContext
from hpc_ddp.runtime.loop.intervals import MetricLog
from hpc_ddp.runtime.loop.position import Position
from hpc_ddp.runtime.loop.stopper import Stopper
from hpc_ddp.runtime.loop.streams import StreamStates
from hpc_ddp.runtime.preempt.job_end import (
    UNMEASURED_SAVE_S,
    JobEnd,
    StopBeforeEnd,
    job_end_for,
    left_from_environ,
    parse_time_left,
    stop_time,
)
from hpc_ddp.runtime.preempt.liveness import ProcessStops
from hpc_ddp.runtime.preempt.signals import StopSignals
from hpc_ddp.runtime.session.joining import resolve_launch
from hpc_ddp.runtime.tracking.base import NullTracker
from tests.helpers import HandClock


@pytest.mark.parametrize(
    ("shown", "seconds"),
    [
        ("0:45", 45.0),
        ("12:03", 723.0),
        ("1:00:00", 3600.0),
        ("2-03:04:05", ((2 * 24 + 3) * 60 + 4) * 60 + 5.0),
        ("UNLIMITED", None),
        ("NOT_SET", None),
        ("INVALID", None),
        ("", None),
    ],
)
def test_squeues_time_left_is_read_in_seconds(shown: str, seconds: float | None) -> None:
    assert parse_time_left(shown) == seconds


def test_the_environments_end_time_is_used_where_slurm_sets_one() -> None:
    assert left_from_environ({"SLURM_JOB_END_TIME": "1000"}, now_unix=900.0) == 100.0
    assert left_from_environ({"SLURM_JOB_END_TIME": "0"}, now_unix=900.0) is None
    assert left_from_environ({}, now_unix=900.0) is None


def test_the_end_follows_a_changed_limit_and_keeps_the_last_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answers: list[float | None] = [600.0, 590.0, None, 100.0]
    clock = HandClock(1000.0)
    job_end = JobEnd(lambda: answers.pop(0), every_s=None, clock=clock).start()
    assert job_end.end == 1600.0 and job_end.left() == 600.0
    clock.now += 10
    job_end.refresh()  # 590 s left 10 s later: the same end
    assert job_end.end == 1600.0
    job_end.refresh()  # squeue did not answer
    assert job_end.end == 1600.0
    with caplog.at_level(logging.INFO, logger="hpc_ddp"):
        job_end.refresh()  # scontrol update TimeLimit: 100 s left now
    assert job_end.end == 1110.0 and job_end.left() == 100.0
    assert "the job's end moved -490 s" in caplog.text


def test_a_stop_needs_the_save_two_checks_and_the_margin() -> None:
    unmeasured = stop_time(None, check_period_s=1.5, margin_s=60.0)
    assert unmeasured.seconds == UNMEASURED_SAVE_S + 3.0 + 60.0
    assert "not measured yet" in unmeasured.reason()
    measured = stop_time(4.0, check_period_s=0.5, margin_s=10.0)
    assert measured.seconds == 15.0 and "4 s, measured" in measured.reason()


def first_due(watch: StopBeforeEnd, clock: HandClock, every_s: float) -> float:
    """The clock at the first check (one each ``every_s``) at which the stop is due."""
    while not watch.due():
        clock.now += every_s
    return clock.now


@pytest.mark.parametrize(("save_s", "due_at"), [(None, 1108.0), (4.0, 1134.0)])
def test_the_stop_begins_when_the_time_left_is_what_a_stop_needs(
    save_s: float | None, due_at: float
) -> None:
    """The job ends at 1200; checks once a second; a stop needs the save (30 s unmeasured),
    two checks (2 s) and the 60 s margin."""
    clock = HandClock(1000.0)
    job_end = JobEnd(lambda: 200.0, every_s=None, clock=clock).start()
    watch = StopBeforeEnd(job_end, lambda: save_s, margin_s=60.0, clock=clock)
    assert first_due(watch, clock, every_s=1.0) == due_at


def test_a_suspension_is_no_gap_between_checks_and_the_end_is_read_again_after_it() -> None:
    """The job ends at 1300 and checks once a second, its watchdog looking every 0.5 s.
    Suspended for 100 s (nothing ran), it is resumed with Slurm's end moved by as much: the
    end is read again at the next check, and the suspension is no gap between checks, so the
    stop comes when the moved end is near, not at the resume. Before, the 100 s gap made a
    stop need over 200 s and the end was the old one: the job stopped and requeued at once."""
    clock = HandClock(1000.0)
    slurm_end = [1300.0]
    job_end = JobEnd(lambda: slurm_end[0] - clock.now, every_s=None, clock=clock).start()
    stops = ProcessStops(0.5, clock, HandClock(0.0), HandClock(0.0))  # no CPU time: stopped
    stops.look()
    watch = StopBeforeEnd(job_end, lambda: 4.0, 60.0, clock=clock, stopped_s=stops.total_at)

    def second_of_training() -> bool:
        """One check, then a second with the watchdog's two looks; whether the stop was due."""
        due = watch.due()
        for _ in range(2):
            clock.now += 0.5
            stops.look()
        return due

    assert not any(second_of_training() for _ in range(10))
    clock.now += 100  # suspended
    slurm_end[0] += 100
    assert not watch.due(), "the check after the resume, before the watchdog's next look"
    assert job_end.end == 1400.0, "read again"
    while not second_of_training():
        pass
    # The gap across the suspension counts 1.5 s: its second, and one look's period of it.
    assert clock.now - 1.0 == 1400.0 - (4.0 + 2 * 1.5 + 60.0)


def test_only_a_slurm_job_that_asks_reads_its_end() -> None:
    assert job_end_for({}, PreemptConfig()) is None, "not a Slurm job"
    off = PreemptConfig(stop_before_end=False)
    assert job_end_for({"SLURM_JOB_ID": "5"}, off) is None
    assert job_end_for({"SLURM_JOB_ID": "5"}, PreemptConfig()) is not None


def test_bad_end_settings_are_refused_naming_the_key() -> None:
    with pytest.raises(HpcDdpError, match=r"preempt\.end_margin_s=-1"):
        PreemptConfig(end_margin_s=-1)
    with pytest.raises(HpcDdpError, match=r"preempt\.end_check_every_s=0"):
        PreemptConfig(end_check_every_s=0)


def stopper_in_a_job(tmp_path: Path, seconds_left: int, margin_s: float) -> Stopper:
    """A stopper of rank 0 of Slurm job 7, whose end is ``seconds_left`` away (from the
    environment; read once, so no squeue runs)."""
    settings = RuntimeConfig(
        run=RunConfig(output_dir=str(tmp_path), id="unit"),
        preempt=PreemptConfig(end_margin_s=margin_s, end_check_every_s=None, requeue=False),
    )
    plan = resolve_launch(settings, "unit", {})
    plan.run_dir.mkdir(parents=True)
    environ = {"SLURM_JOB_ID": "7", "SLURM_JOB_END_TIME": str(int(time.time()) + seconds_left)}
    context = RunContext(
        config=settings,
        plan=plan,
        control_group=None,
        signals=StopSignals("USR1"),
        tracker=NullTracker(),
        environ=environ,
        fingerprint={},
        log_interval=None,
    )
    position = Position()
    checkpointer = Checkpointer(
        context, position, MetricLog(context), StreamStates(0, 1), nullcontext
    )
    return Stopper(context, position, checkpointer)


def test_a_job_whose_end_is_too_near_at_the_start_trains_on_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Stopping at once would requeue the job into the same too-short limit, again and again:
    the stop is left to Slurm's signals."""
    stopper = stopper_in_a_job(tmp_path, seconds_left=100, margin_s=200.0)
    with caplog.at_level(logging.INFO, logger="hpc_ddp"):
        stopper.begin()
        assert stopper.decide() == (False, False)
    assert "the ranks stop with a checkpoint and requeue once about 230 s" in caplog.text
    assert "sooner than a stop needs" in caplog.text and "HINT: ask for a longer --time" in (
        caplog.text
    )
    assert not stopper.context.signals.requested
    stopper.close()


def test_the_watch_arms_again_when_the_end_moves_and_stops_as_the_warning_signal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock, answers = HandClock(1000.0), [100.0, 100.0, 3000.0, 80.0]
    job_end = JobEnd(lambda: answers.pop(0), every_s=None, clock=clock).start()
    watch = StopBeforeEnd(job_end, lambda: None, margin_s=60.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="hpc_ddp"):
        assert not watch.due(), "too near at the first check: left to the signals"
        clock.now += 1
        assert not watch.due(), "the same end"
        job_end.refresh()  # 100 s left: the same end as before
        assert not watch.due()
        job_end.refresh()  # the limit raised
        assert not watch.due()
        job_end.refresh()  # and shortened again: the stop is due now
        assert watch.due()
    assert "stopping before the job's time limit" in caplog.text


def test_the_stopper_stops_on_the_jobs_end_as_on_the_warning_signal(tmp_path: Path) -> None:
    stopper = stopper_in_a_job(tmp_path, seconds_left=100_000, margin_s=60.0)
    stopper.begin()
    assert stopper.decide() == (False, False)
    stopper.context.signals.rehearse()  # what the watch does when the stop is due
    assert stopper.decide() == (True, False) and stopper.context.signals.wants_requeue
    stopper.position.global_step = 5
    with pytest.raises(Stopped) as stopped:
        stopper.stop()
    assert stopped.value.step == 5
    assert list_checkpoints(checkpoint_dir(stopper.context.run_dir))[0].name == "step-000000005"
    stopper.close()


def test_a_job_far_from_its_end_trains_on(tmp_path: Path) -> None:
    stopper = stopper_in_a_job(tmp_path, seconds_left=100_000, margin_s=60.0)
    stopper.begin()
    assert stopper.decide() == (False, False)
    assert not stopper.context.signals.requested
    stopper.close()


@pytest.mark.parametrize("answered", ["as_asked", "as_returned"])
def test_a_slow_read_of_the_time_left_does_not_move_the_end(
    answered: str, caplog: pytest.LogCaptureFixture
) -> None:
    """squeue may take seconds on a busy machine, and its answer may come at any moment
    of that: a read 8 s long whose end is the same within those 8 s moves nothing, and a
    real change after it is still said."""
    clock = HandClock(1000.0)
    true_end = [1600.0]

    def squeue(read_s: float) -> float:
        left_when_asked = true_end[0] - clock.now
        clock.now += read_s
        return left_when_asked if answered == "as_asked" else true_end[0] - clock.now

    reads = iter([0.0, 8.0, 0.0, 8.0])
    job_end = JobEnd(lambda: squeue(next(reads)), every_s=None, clock=clock).start()
    assert job_end.end == 1600.0
    clock.now += 10
    with caplog.at_level(logging.INFO, logger="hpc_ddp"):
        job_end.refresh()  # slow, same end
        clock.now += 10
        job_end.refresh()  # quick, same end
        assert "moved" not in caplog.text and job_end.end is not None
        assert 1592.0 <= job_end.end <= 1600.0, "never later than it is"
        true_end[0] = 1300.0  # scontrol update TimeLimit
        clock.now += 10
        job_end.refresh()  # slow, a new end
    assert job_end.end is not None and 1292.0 <= job_end.end <= 1300.0
    assert "the job's end moved -3" in caplog.text
