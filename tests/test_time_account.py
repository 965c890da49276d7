"""Where an attempt's time went and the run's goodput over its attempts: the arithmetic with
given times and an injected clock, and attempts.json as rank 0 keeps it (no process is
started here; test_user_script.py checks a real stopped and resumed run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.runtime.monitor.account import (
    PARTS,
    account_line,
    attempt_account,
    redone_steps,
    run_account,
)
from hpc_ddp.runtime.monitor.attempt_times import AttemptTimes, StepsMark
from hpc_ddp.runtime.monitor.timeline import mark_allocation_start, slurm_job_start_unix
from hpc_ddp.runtime.preempt.progress import (
    end_attempt,
    forget_attempt,
    read_attempts,
    record_attempt,
)
from hpc_ddp.view.runs import time_lines
from tests.helpers import HandClock


def test_the_steps_time_leaves_out_the_checkpoints_and_evaluations_made_inside_them() -> None:
    clock = HandClock()
    times = AttemptTimes(clock=clock)
    with times.counting("resume"):
        clock.now += 3.0
    began = times.mark()
    with times.counting("checkpoint"):  # a periodic save inside run.steps
        clock.now += 2.0
    with times.counting("evaluation"):  # an evaluation inside run.steps
        clock.now += 1.5
    times.add_steps(10.0, began)
    assert (times.resume_s, times.checkpoint_s, times.evaluation_s) == (3.0, 2.0, 1.5)
    assert times.steps_s == pytest.approx(6.5)


def test_an_attempts_parts_add_up_to_its_allocation_and_redone_steps_are_not_goodput() -> None:
    timeline = {"process_start_unix": 1000.0, "entry_unix": 1003.0, "training_unix": 1012.0}
    times = AttemptTimes(resume_s=2.0, checkpoint_s=4.0, evaluation_s=6.0, steps_s=60.0)
    times.add_steps(60.0, StepsMark(0.0, 0.0))  # the first run.steps, nothing paused before
    times.steps_s = 60.0
    account = attempt_account(timeline, 1100.0, times, steps_taken=120, steps_redone=30)
    assert account == {
        "startup_s": 10.0,  # to the training mark, less the 2 s resume before it
        "resume_s": 2.0,
        "steps_s": 45.0,
        "redone_s": 15.0,  # 30 of the 120 steps were taken before the crash
        "checkpoint_s": 4.0,
        "evaluation_s": 6.0,
        "stop_s": 0.0,
        "end_s": 0.0,
        "suspended_s": 0.0,
        "other_s": 18.0,
        "allocation_s": 100.0,
        "goodput_percent": 45.0,
    }
    assert account_line(account) == (
        "100.0 s: startup 10.0, resume 2.0, steps 45.0, redone 15.0, checkpoint 4.0, "
        "evaluation 6.0, stop 0.0, end 0.0, other 18.0; goodput 45%"
    )


def test_an_attempt_in_the_job_s_first_step_is_charged_from_slurm_s_start_of_the_job() -> None:
    """The batch script before ``srun`` (modules, environments, data staging) holds the
    allocation too: the start-up runs from the job's start, not from the process's."""
    timeline = {"allocation_start_unix": 970.0, "process_start_unix": 1000.0,
                "entry_unix": 1003.0, "training_unix": 1012.0}  # fmt: skip
    account = attempt_account(timeline, 1100.0, AttemptTimes(steps_s=60.0), 60, 0)
    assert (account["allocation_s"], account["startup_s"]) == (130.0, 42.0)
    del timeline["allocation_start_unix"]
    account = attempt_account(timeline, 1100.0, AttemptTimes(steps_s=60.0), 60, 0)
    assert (account["allocation_s"], account["startup_s"]) == (100.0, 12.0)


def test_the_job_s_start_is_slurm_s_only_where_all_of_the_job_so_far_was_this_attempt() -> None:
    asked: list[str] = []

    def squeue(job: str) -> float | None:
        asked.append(job)
        return 900.0

    step = {"SLURM_JOB_ID": "41", "SLURM_STEP_ID": "0", "ENVIRONMENT": "BATCH"}
    assert slurm_job_start_unix({**step, "SLURM_JOB_START_TIME": "950"}, 0, squeue) == 950.0
    assert asked == [], "Slurm 23.02 and later say it: squeue is not asked"
    assert slurm_job_start_unix(step, 0, squeue) == 900.0 and asked == ["41"]
    array_task = {**step, "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"}
    assert slurm_job_start_unix(array_task, 0, squeue) == 900.0 and asked[-1] == "40_3"
    asked.clear()
    batch_step = {"SLURM_JOB_ID": "41", "ENVIRONMENT": "BATCH"}
    assert slurm_job_start_unix(batch_step, 0, squeue) is None, "the batch step"
    salloc = {"SLURM_JOB_ID": "41", "SLURM_STEP_ID": "0"}
    assert slurm_job_start_unix(salloc, 0, squeue) is None, "salloc, then srun: a person's"
    shell = {**step, "SLURM_PTY_PORT": "40123"}
    assert slurm_job_start_unix(shell, 0, squeue) is None, "srun --pty bash in a batch job"
    assert slurm_job_start_unix({**step, "SLURM_STEP_ID": "1"}, 0, squeue) is None, "a later step"
    assert slurm_job_start_unix(step, 1, squeue) is None, "torchrun restarted the workers"
    not_slurm = {"SLURM_STEP_ID": "0", "ENVIRONMENT": "BATCH"}
    assert slurm_job_start_unix(not_slurm, 0, squeue) is None, "not Slurm"
    assert asked == []


def test_a_job_start_after_the_process_start_is_another_clock_and_left_out() -> None:
    timeline = {"process_start_unix": 1000.0, "entry_unix": 1003.0}
    mark_allocation_start(timeline, 1001.0)
    assert "allocation_start_unix" not in timeline
    mark_allocation_start(timeline, None)
    assert "allocation_start_unix" not in timeline
    mark_allocation_start(timeline, 990.0)
    assert timeline["allocation_start_unix"] == 990.0


def test_a_stop_agreed_inside_the_steps_is_the_stop_less_its_checkpoint() -> None:
    clock = HandClock()
    times = AttemptTimes(clock=clock)
    began = times.mark()  # run.steps begins
    clock.now += 30.0  # steps
    times.begin_ending("stop")  # the ranks agreed to stop
    with times.counting("checkpoint"):  # the stop's checkpoint
        clock.now += 4.0
    clock.now += 1.5  # the requeue and the ranks' exchange
    times.add_steps(35.5, began)  # Stopped leaves run.steps
    times.begin_ending("end")  # the end that follows a stop is part of the stop
    clock.now += 0.5
    assert times.steps_s == pytest.approx(30.0), "the stop is not a step"
    account = attempt_account({"entry_unix": 0.0, "training_unix": 2.0}, 38.0, times, 10, 0)
    assert (account["stop_s"], account["end_s"], account["checkpoint_s"]) == (2.0, 0.0, 4.0)
    assert (account["startup_s"], account["steps_s"], account["other_s"]) == (2.0, 30.0, 0.0)
    assert sum(account[f"{part}_s"] for part in PARTS) == account["allocation_s"] == 38.0


def test_the_end_after_the_last_step_is_its_own_part() -> None:
    clock = HandClock()
    times = AttemptTimes(clock=clock)
    times.add_steps(20.0, times.mark())
    clock.now += 20.0
    clock.now += 3.0  # the script's own work after training (in other)
    times.begin_ending("end")  # run.finish()
    with times.counting("checkpoint"):  # the final checkpoint
        clock.now += 5.0
    clock.now += 1.0  # summary.json, the ranks' spread
    account = attempt_account({"entry_unix": 0.0, "training_unix": 0.0}, 29.0, times, 10, 0)
    assert (account["end_s"], account["stop_s"], account["checkpoint_s"]) == (1.0, 0.0, 5.0)
    assert (account["steps_s"], account["other_s"]) == (20.0, 3.0)


def test_time_the_process_did_not_run_is_suspended_not_the_part_it_fell_in() -> None:
    clock, suspended = HandClock(0.0), HandClock(0.0)  # suspended: what the looks found
    times = AttemptTimes(clock=clock, suspended=suspended)
    clock.now += 2.0  # start-up
    times.training_began()
    began = times.mark()  # run.steps begins
    clock.now += 10.0  # steps
    clock.now += 60.0  # scontrol suspend ... resume, while a step ran
    suspended.now += 60.0
    with times.counting("checkpoint"):  # a save, suspended halfway
        clock.now += 3.0
        suspended.now += 20.0
        clock.now += 20.0
    clock.now += 5.0  # steps
    times.begin_ending("stop")
    clock.now += 1.0
    suspended.now += 10.0  # suspended during the stop
    clock.now += 10.0
    times.add_steps(clock.now - 2.0, began)
    account = attempt_account({"entry_unix": 0.0, "training_unix": 2.0}, clock.now, times, 10, 0)
    assert (account["steps_s"], account["checkpoint_s"], account["stop_s"]) == (15.0, 3.0, 1.0)
    assert (account["suspended_s"], account["startup_s"], account["other_s"]) == (90.0, 2.0, 0.0)
    assert sum(account[f"{part}_s"] for part in PARTS) == account["allocation_s"] == 111.0
    # Of the whole allocation: rank 0 cannot tell a suspension Slurm does not charge from a
    # SIGSTOP or a hung host, which it does.
    assert account["goodput_percent"] == round(100 * 15.0 / 111.0, 2)
    total = run_account([{"from_step": 0, "account": account, "ranks": 4}])
    assert (total["suspended_s"], total["rank_hours"]) == (90.0, round(111.0 * 4 / 3600, 4))


def test_a_pause_between_the_reading_and_the_end_falls_in_other() -> None:
    """The end's wall time is read after the parts: a process descheduled between the two
    reads adds that time to `other`, and the parts still add up to the allocation (read the
    other way round, the pause would count in the stop and outgrow the allocation)."""
    clock = HandClock(0.0)
    times = AttemptTimes(clock=clock)
    clock.now += 2.0
    times.training_began()
    began = times.mark()
    clock.now += 10.0
    times.begin_ending("stop")
    clock.now += 1.0
    times.add_steps(clock.now - 2.0, began)
    reading = times.reading()
    clock.now += 5.0  # descheduled between the two reads
    timeline = {"entry_unix": 0.0, "training_unix": 2.0}
    account = attempt_account(timeline, clock.now, times, 10, 0, reading)
    assert (account["stop_s"], account["other_s"]) == (1.0, 5.0)
    assert sum(account[f"{part}_s"] for part in PARTS) == account["allocation_s"] == 18.0
    late = attempt_account(timeline, clock.now - 5.0, times, 10, 0)
    assert sum(late[f"{part}_s"] for part in PARTS) > late["allocation_s"]


def test_an_attempt_suspended_before_it_trained_counts_the_suspension_once() -> None:
    clock, suspended = HandClock(0.0), HandClock(0.0)
    times = AttemptTimes(clock=clock, suspended=suspended)
    with times.counting("resume"):
        clock.now += 5.0
        suspended.now += 3.0
    clock.now += 2.0  # failed before run.steps
    account = attempt_account({"entry_unix": 0.0}, clock.now, times, 0, 0)
    assert (account["resume_s"], account["suspended_s"], account["startup_s"]) == (2.0, 3.0, 2.0)
    assert sum(account[f"{part}_s"] for part in PARTS) == account["allocation_s"] == 7.0


def test_an_account_recorded_before_the_stop_and_end_were_parts_still_reads() -> None:
    old = {"startup_s": 1.0, "resume_s": 0.0, "steps_s": 8.0, "redone_s": 0.0,
           "checkpoint_s": 0.5, "evaluation_s": 0.0, "other_s": 0.5, "allocation_s": 10.0,
           "goodput_percent": 80.0}  # fmt: skip
    total = run_account([{"from_step": 0, "account": old, "ranks": 2}])
    assert (total["steps_s"], total["stop_s"], total["end_s"], total["allocation_s"]) == (
        8.0, 0.0, 0.0, 10.0,
    )  # fmt: skip
    assert account_line(old) == (
        "10.0 s: startup 1.0, resume 0.0, steps 8.0, redone 0.0, checkpoint 0.5, "
        "evaluation 0.0, other 0.5; goodput 80%"
    )


def test_an_attempt_that_never_trained_is_all_startup() -> None:
    account = attempt_account({"entry_unix": 50.0}, 80.0, AttemptTimes(), 0, 0)
    assert (account["startup_s"], account["allocation_s"], account["goodput_percent"]) == (
        30.0,
        30.0,
        0.0,
    )


@pytest.mark.parametrize(
    ("earlier_last", "from_step", "last", "redone"),
    [(None, 100, 300, 0), (130, 100, 300, 30), (100, 100, 300, 0), (500, 100, 300, 200)],
)
def test_steps_redone_are_those_an_earlier_attempt_took_past_the_checkpoint(
    earlier_last: int | None, from_step: int, last: int, redone: int
) -> None:
    assert redone_steps(earlier_last, from_step, last) == redone


def test_a_run_sums_its_attempts_counts_the_killed_one_and_the_wait_between() -> None:
    part = {f"{name}_s": 0.0 for name in ("startup", "resume", "redone", "checkpoint")}
    part["goodput_percent"] = 0.0  # not summed: the run's is worked out again
    first = {**part, "steps_s": 30.0, "evaluation_s": 0.0, "other_s": 10.0, "allocation_s": 40.0}
    second = {**part, "steps_s": 50.0, "evaluation_s": 5.0, "other_s": 5.0, "allocation_s": 60.0}
    attempts: list[dict[str, Any]] = [
        {"from_step": 0, "ranks": 4, "start_unix": 0.0, "end_unix": 40.0, "account": first},
        {"from_step": 10, "start_unix": 100.0},  # killed: no end, no account
        {"from_step": 10, "ranks": 2, "start_unix": 400.0, "end_unix": 460.0, "account": second},
    ]
    total = run_account(attempts)
    assert total["allocation_s"] == 100.0 and total["steps_s"] == 80.0
    assert total["goodput_percent"] == 80.0
    assert total["rank_hours"] == pytest.approx((40 * 4 + 60 * 2) / 3600, abs=1e-4)
    assert total["queued_s"] == 60.0, "only between an end and the next start that are known"
    assert (total["attempts"], total["attempts_unaccounted"]) == (3, 1)
    damaged = [{**attempts[0], "account": {**first, "steps_s": "a lot"}}, attempts[2]]
    assert run_account(damaged)["allocation_s"] == 60.0, "a damaged account is passed over"


def test_rank_0_adds_each_attempts_end_to_its_own_entry(tmp_path: Path) -> None:
    times = AttemptTimes(steps_s=8.0)
    timeline = {"process_start_unix": 1.0, "training_unix": 3.0}
    record_attempt(tmp_path, None, 0, 0, "first")
    end_attempt(tmp_path, "first", timeline, times, 2, None, 130, 0)
    record_attempt(tmp_path, None, 0, 120, "second")  # outside a job: each start an attempt
    total = end_attempt(tmp_path, "second", timeline, times, 2, "FINISHED", 300, 120)
    first, second = read_attempts(tmp_path)
    assert (first["status"], first["last_step"], first["redone_steps"]) == ("stopped", 130, 0)
    assert (second["status"], second["from_step"], second["last_step"]) == ("finished", 120, 300)
    assert second["redone_steps"] == 10, "steps 121..130 were taken before"
    assert second["account"]["redone_s"] == pytest.approx(8.0 * 10 / 180, abs=1e-3)
    assert total is not None and total["attempts"] == 2


def test_a_torchrun_restart_in_the_allocation_keeps_the_crashed_attempts_account(
    tmp_path: Path,
) -> None:
    """Under Slurm's torchrun template a crash restarts the ranks in the same job and
    SLURM_RESTART_COUNT: the no-progress count sees one attempt, the account both."""
    timeline = {"process_start_unix": 0.0, "training_unix": 2.0}
    assert len(record_attempt(tmp_path, "7", 0, 100, "crashed")) == 1
    end_attempt(tmp_path, "crashed", timeline, AttemptTimes(steps_s=5.0), 4, "FAILED", 130, 100)
    counted = record_attempt(tmp_path, "7", 0, 100, "restarted")
    assert [(a["restart_count"], a["attempt"]) for a in counted] == [(0, "restarted")]
    end_attempt(tmp_path, "restarted", timeline, AttemptTimes(steps_s=20.0), 4, "FINISHED",
                300, 100)  # fmt: skip
    crashed, restarted = read_attempts(tmp_path)
    assert (crashed["status"], crashed["last_step"]) == ("failed", 130)
    assert restarted["redone_steps"] == 30, "101..130 again after the crash"


def log_lines(run_dir: Path, *entries: tuple[float, int]) -> None:
    """metrics.jsonl as rank 0's journal writes it: an attempt's mark, then its intervals."""
    lines = [json.dumps({"attempt": 1, "from_step": 0, "time": entries[0][0]})]
    lines += [
        json.dumps({"step": step, "global_step": step, "epoch": 0, "time": at, "metrics": {}})
        for at, step in entries
    ]
    with (run_dir / "metrics.jsonl").open("a") as file:
        file.write("\n".join(lines) + "\n")


def test_an_attempt_killed_outright_is_charged_to_its_last_logged_interval_by_the_next(
    tmp_path: Path,
) -> None:
    """SIGKILL, a lost node or a time limit without warning leave no account: the next
    attempt charges the killed one from its start to its last logged interval (a torn line
    after it is passed over), and takes its steps after the checkpoint as redone."""
    record_attempt(tmp_path, "7", 0, 0, "killed", start_unix=100.0, ranks=4)
    log_lines(tmp_path, (105.0, 10), (112.5, 20))
    with (tmp_path / "metrics.jsonl").open("a") as file:
        file.write('{"step": 30, "global_step": 30, "ti')  # the write the kill cut short
    record_attempt(tmp_path, "7", 1, 10, "next", start_unix=200.0, ranks=4)
    killed = read_attempts(tmp_path)[0]
    assert (killed["status"], killed["last_step"], killed["end_unix"]) == ("killed", 20, 112.5)
    assert killed["account"]["allocation_s"] == killed["account"]["other_s"] == 12.5
    assert killed["account"]["steps_s"] == 0.0, "what it did is not known: not split"
    timeline = {"process_start_unix": 200.0, "training_unix": 203.0}
    total = end_attempt(tmp_path, "next", timeline, AttemptTimes(steps_s=30.0), 4,
                        "FINISHED", 40, 10)  # fmt: skip
    later = read_attempts(tmp_path)[1]
    assert later["redone_steps"] == 10, "steps 11..20 were taken before the kill"
    assert total is not None and total["attempts_unaccounted"] == 0
    assert total["queued_s"] == pytest.approx(200.0 - 112.5)
    assert total["rank_hours"] == pytest.approx(
        (12.5 + later["account"]["allocation_s"]) * 4 / 3600, abs=1e-4
    )
    lines = time_lines(read_attempts(tmp_path), running=False)
    assert lines[0] == "attempt 1 (killed, last logged at step 20): 12.5 s to then, not split"


def test_a_killed_attempt_is_charged_only_for_what_it_logged_itself(tmp_path: Path) -> None:
    """What the next attempt logs before its entry (an evaluation before training) is not
    the killed one's; a last line longer than the first window read is still found; one
    that logged nothing, or an entry from before start times were kept, is only marked."""
    record_attempt(tmp_path, None, 0, 0, "killed", start_unix=100.0, ranks=2)
    log_lines(tmp_path, (110.0, 20))
    log_lines(tmp_path, (120.0, 20))  # a long line: more than a window of the file's tail
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    long = json.loads(lines[-1])
    long["metrics"] = {f"m{n}": 1.0 for n in range(8000)}
    lines[-1] = json.dumps(long)
    log_lines_text = "\n".join(lines) + "\n"
    (tmp_path / "metrics.jsonl").write_text(log_lines_text)
    log_lines(tmp_path, (205.0, 0))  # the next attempt's evaluation before its first step
    record_attempt(tmp_path, None, 0, 0, "next", start_unix=200.0, ranks=2)
    killed = read_attempts(tmp_path)[0]
    assert (killed["end_unix"], killed["last_step"]) == (120.0, 20)
    assert killed["account"]["allocation_s"] == 20.0

    silent_dir = tmp_path / "silent"
    silent_dir.mkdir()
    log_lines(silent_dir, (50.0, 5))  # an earlier attempt's interval, before this one began
    record_attempt(silent_dir, None, 0, 5, "silent", start_unix=100.0, ranks=2)
    record_attempt(silent_dir, None, 0, 5, "next", start_unix=300.0, ranks=2)
    silent = read_attempts(silent_dir)[0]
    assert silent["status"] == "killed"
    assert "account" not in silent and "end_unix" not in silent, "nothing to charge it from"
    total = run_account(read_attempts(silent_dir))
    assert (total["attempts_unaccounted"], total["queued_s"]) == (2, 0.0)
    assert time_lines(read_attempts(silent_dir), running=True) == [], "no account to show"

    old = tmp_path / "old"
    old.mkdir()
    record_attempt(old, None, 0, 0, "from-before")  # no start: as records were kept before
    record_attempt(old, None, 0, 0, "next")
    assert "account" not in read_attempts(old)[0]


def test_an_attempt_that_ended_before_its_entry_leaves_the_earlier_one_alone(
    tmp_path: Path,
) -> None:
    record_attempt(tmp_path, None, 0, 0, "earlier")
    assert end_attempt(tmp_path, "later", {}, AttemptTimes(), 1, "FAILED", 0, 0) is None
    assert "account" not in read_attempts(tmp_path)[0]
    forget_attempt(tmp_path, "later")
    assert len(read_attempts(tmp_path)) == 1
    forget_attempt(tmp_path, "earlier")  # it found the run finished: no attempt at all
    assert read_attempts(tmp_path) == []


def test_a_span_inside_another_counts_once_and_startup_leaves_out_work_before_training() -> None:
    clock = HandClock()
    times = AttemptTimes(clock=clock)
    with times.counting("evaluation"), times.counting("evaluation"):
        clock.now += 2.0  # two evaluation loaders zipped
    with times.counting("evaluation"), times.counting("checkpoint"):
        clock.now += 1.0  # a save made while evaluating
    assert (times.evaluation_s, times.checkpoint_s) == (3.0, 0.0)
    times.add_steps(10.0, times.mark())  # the first run.steps: all of it steps
    account = attempt_account({"entry_unix": 0.0, "training_unix": 5.0}, 20.0, times, 10, 0)
    assert account["startup_s"] == 2.0, "the 3 s evaluated before training are not startup"
    assert sum(account[f"{part}_s"] for part in PARTS) == account["allocation_s"] == 20.0


def test_runs_shows_each_attempts_account_and_the_runs() -> None:
    account = attempt_account({"process_start_unix": 0.0, "training_unix": 5.0}, 20.0,
                              AttemptTimes(steps_s=10.0), 100, 0)  # fmt: skip
    attempts: list[dict[str, Any]] = [
        {"from_step": 0, "status": "stopped", "last_step": 100, "end_unix": 20.0,
         "start_unix": 0.0, "ranks": 2, "account": account},
        {"from_step": 100},
    ]  # fmt: skip
    assert time_lines(attempts, running=False) == [
        "attempt 1 (stopped at step 100): 20.0 s: startup 5.0, resume 0.0, steps 10.0, "
        "redone 0.0, checkpoint 0.0, evaluation 0.0, stop 0.0, end 0.0, other 5.0; goodput 50%",
        "attempt 2 (ended unseen): no account, killed before it could write one",
        "all attempts: 20.0 s: startup 5.0, resume 0.0, steps 10.0, redone 0.0, checkpoint 0.0,"
        " evaluation 0.0, stop 0.0, end 0.0, other 5.0; goodput 50%, 0.0111 rank-hours, 0 s "
        "queued between attempts",
    ]
    assert time_lines(attempts, running=True)[1] == "attempt 2 (running)"
    assert time_lines([{"from_step": 0}], False) == [], "a record from before accounts were kept"


def test_a_record_that_cannot_be_kept_costs_one_warning_and_the_run_still_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from hpc_ddp.runtime.loop.position import Position
    from hpc_ddp.runtime.preempt.signals import StopSignals
    from hpc_ddp.runtime.session.ending import Ending
    from hpc_ddp.runtime.tracking.base import NullTracker

    finished: list[str] = []

    class Tracker(NullTracker):
        def finish(self, status: str) -> None:
            finished.append(status)

    def damaged(status: str | None, last_step: int, from_step: int) -> None:
        raise ValueError("could not convert string to float: 'soon'")

    tracker = Tracker()
    ending = Ending(
        StopSignals("USR1"), "0", tracker, lambda wait: None, Position(), damaged, print
    )
    ending("FAILED")
    assert finished == ["FAILED"], "MLflow still hears how the run ended"
    assert ending.account is None
    assert "the attempt's time account was not recorded (ValueError: could not convert" in (
        caplog.text
    )


def test_an_attempt_that_only_finishes_charges_its_end_to_the_end_not_to_its_start() -> None:
    """A requeued attempt whose epochs were all done (the stop came at the last step): it
    begins training, yields no step and calls run.finish()."""
    clock = HandClock()
    times = AttemptTimes(clock=clock)
    with times.counting("resume"):
        clock.now += 1.0
    times.training_began()  # at 5 s: run.epochs() yields nothing
    times.begin_ending("end")  # run.finish()
    with times.counting("checkpoint"):
        clock.now += 2.0
    clock.now += 1.0
    account = attempt_account({"entry_unix": 0.0, "training_unix": 5.0}, 8.0, times, 0, 0)
    assert (account["startup_s"], account["resume_s"], account["checkpoint_s"]) == (4.0, 1.0, 2.0)
    assert (account["end_s"], account["other_s"]) == (1.0, 0.0)
