"""The attempts in `hpc-ddp plot`: with --goodput, one bar per attempt on the run's clock,
split into its account's parts; in the curves, a line where each attempt resumed. From a
run's attempts.json and metrics.jsonl as rank 0 keeps them (no process is started)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.image import imread

from hpc_ddp.cli import main
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.monitor.account import PARTS, attempt_account, unsplit_account
from hpc_ddp.runtime.monitor.attempt_times import AttemptTimes
from hpc_ddp.view.attempt_marks import (
    HEADROOM,
    mark_attempts,
    name_rows,
    resume_steps,
    with_headroom,
)
from hpc_ddp.view.goodput import DRAWN, PART_COLOURS, attempt_bars, plot_goodput
from hpc_ddp.view.machines import broken_at, draw_usage
from hpc_ddp.view.plot import plot_run
from hpc_ddp.view.runs import load_run
from tests.helpers import HandClock


def three_attempts() -> list[dict[str, Any]]:
    """Stopped by the warning signal at step 100; killed outright after logging step 140;
    resumed from step 100 to the end (40 steps redone). The job waited 30 s and 60 s."""
    clock = HandClock()
    first_times = AttemptTimes(steps_s=80.0, checkpoint_s=4.0, paused_before_training_s=0.0,
                               clock=clock)  # fmt: skip
    first_times.begin_ending("stop")
    clock.now += 2.0  # the requeue
    first = attempt_account({"process_start_unix": 1000.0, "training_unix": 1010.0}, 1100.0,
                            first_times, 100, 0)  # fmt: skip
    third = attempt_account({"process_start_unix": 1230.0, "training_unix": 1238.0}, 1330.0,
                            AttemptTimes(steps_s=84.0, resume_s=2.0), 140, 40)  # fmt: skip
    return [
        {"from_step": 0, "status": "stopped", "last_step": 100, "ranks": 2,
         "start_unix": 1000.0, "end_unix": 1100.0, "account": first},
        {"from_step": 100, "status": "killed", "last_step": 140, "ranks": 2,
         "start_unix": 1130.0, "end_unix": 1170.0, "account": unsplit_account(40.0)},
        {"from_step": 100, "status": "finished", "last_step": 240, "ranks": 2,
         "start_unix": 1230.0, "end_unix": 1330.0, "account": third},
    ]  # fmt: skip


def run_with(tmp_path: Path, attempts: list[dict[str, Any]]) -> Path:
    run_dir = tmp_path / "runs" / "digits" / "a"
    run_dir.mkdir(parents=True)
    (run_dir / "status.json").write_text(json.dumps({"state": "finished", "global_step": 240}))
    (run_dir / "attempts.json").write_text(json.dumps(attempts))
    return run_dir


def test_each_attempt_is_a_bar_at_its_start_split_into_its_parts() -> None:
    first, killed, third = attempt_bars(three_attempts())
    assert [bar.start_s for bar in (first, killed, third)] == [0.0, 130.0, 230.0]
    assert first.parts == {"startup": 10.0, "resume": 0.0, "steps": 80.0, "redone": 0.0,
                           "checkpoint": 4.0, "evaluation": 0.0, "stop": 2.0, "end": 0.0,
                           "suspended": 0.0, "other": 4.0}  # fmt: skip
    assert sum(first.parts.values()) == 100.0, "a bar is as long as the attempt's allocation"
    assert third.parts["redone"] == pytest.approx(84.0 * 40 / 140, abs=1e-3)
    assert killed.unsplit and killed.parts["other"] == 40.0
    assert killed.label == "attempt 2: killed, last logged at step 140, not split"
    assert first.label == "attempt 1: stopped at step 100, goodput 80%"
    no_times = attempt_bars([{**three_attempts()[0], "start_unix": None}, {"from_step": 100}])
    assert no_times[1].start_s == 100.0 and no_times[1].parts == {}, (
        "without a start time an attempt follows the one before; without an account it has no parts"
    )
    assert no_times[1].label == "attempt 2: no account (running, or ended unseen)"


def test_the_picture_draws_every_part_where_it_happened(tmp_path: Path) -> None:
    run = load_run(run_with(tmp_path, three_attempts()))
    assert run is not None
    figure = plot_goodput(run)
    [axes] = figure.axes
    drawn = [(patch.get_x(), patch.get_width(), patch.get_facecolor()) for patch in axes.patches]
    assert len(drawn) == 5 + 1 + 5, "the parts above zero of the three attempts"
    # 330 s from the first start to the last end: drawn in minutes.
    assert axes.get_xlabel() == (
        "min since the first attempt began (gaps: the queue, or a killed attempt's time after "
        "its last log)"
    )
    redone = to_rgba(PART_COLOURS["redone"])
    red = [(x * 60, width * 60) for x, width, colour in drawn if colour == redone]
    # The third attempt: start-up 6 s, resume 2 s, then the 24 s redone (the first steps after
    # the resume), then 60 s of new steps.
    assert red == [pytest.approx((230.0 + 6.0 + 2.0, 24.0))]
    green = [(x * 60, width * 60) for x, width, colour in drawn
             if colour == to_rgba(PART_COLOURS["steps"])]  # fmt: skip
    assert green == [pytest.approx((10.0, 80.0)), pytest.approx((262.0, 60.0))]
    assert sorted(DRAWN) == sorted(PARTS), "every part drawn"
    hatched = [patch for patch in axes.patches if patch.get_hatch()]
    assert [(p.get_x() * 60, p.get_width() * 60) for p in hatched] == [pytest.approx((130.0, 40.0))]
    title = figure.get_suptitle()
    assert title == "digits/a: goodput 58% of 4 min allocated, 0.133 rank-hours, 1.5 min queued"
    legend = [text.get_text() for text in figure.legends[0].get_texts()]
    assert legend == ["startup", "resume", "redone", "steps", "checkpoint", "stop", "other",
                      "killed, not split"]  # fmt: skip


def test_a_suspension_is_drawn_apart_and_said_in_the_title(tmp_path: Path) -> None:
    suspended = HandClock(0.0)
    times = AttemptTimes(steps_s=30.0, paused_before_training_s=0.0, suspended=suspended)
    suspended.now = 60.0  # scontrol suspend ... resume
    account = attempt_account({"process_start_unix": 0.0, "training_unix": 10.0}, 100.0,
                              times, 100, 0)  # fmt: skip
    attempt = {"from_step": 0, "status": "finished", "last_step": 100, "ranks": 4,
               "start_unix": 0.0, "end_unix": 100.0, "account": account}  # fmt: skip
    run = load_run(run_with(tmp_path, [attempt]))
    assert run is not None
    figure = plot_goodput(run)
    [axes] = figure.axes
    cyan = to_rgba(PART_COLOURS["suspended"])
    assert [(p.get_x(), p.get_width()) for p in axes.patches if p.get_facecolor() == cyan] == [
        pytest.approx((40.0, 60.0))
    ], "after start-up and steps, in one piece"
    assert figure.get_suptitle() == (
        "digits/a: goodput 30% of 100 s allocated (60 s of it suspended), 0.111 rank-hours, "
        "0 s queued"
    )


def test_plot_goodput_writes_a_png_and_refuses_a_run_with_no_account(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = run_with(tmp_path, three_attempts())
    assert main(["plot", str(run_dir), "--goodput"]) == 0
    assert capsys.readouterr().out.strip() == str(run_dir / "goodput.png")
    height, width, _ = imread(run_dir / "goodput.png").shape
    assert (width, height) == (1100, 325)
    empty = run_with(tmp_path / "other", [{"from_step": 0}])
    with pytest.raises(HpcDdpError, match="has no time account yet"):
        plot_goodput(load_run(empty))  # type: ignore[arg-type]
    assert main(["plot", str(empty), "--goodput"]) == 2
    assert "HINT: each attempt writes its account" in capsys.readouterr().err


def plotted_over_three_attempts(tmp_path: Path, metrics: Callable[[int], dict[str, float]]) -> Any:
    """The figure of :func:`three_attempts`' run whose record logged ``metrics(step)`` every
    10 steps up to 240."""
    run_dir = run_with(tmp_path, three_attempts())
    points = [
        {"step": step, "global_step": step, "epoch": 0, "time": 1000.0 + step,
         "metrics": metrics(step)}
        for step in range(10, 241, 10)
    ]  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(p) + "\n" for p in points))
    run = load_run(run_dir)
    assert run is not None
    return plot_run(run)


def test_the_curves_mark_where_each_later_attempt_resumed(tmp_path: Path) -> None:
    figure = plotted_over_three_attempts(
        tmp_path, lambda step: {"interval/loss": 1.0 / step, "interval/accuracy": step / 300}
    )
    assert len(figure.axes) == 2, "losses and scores"
    for axes in figure.axes:
        dotted = [line.get_xdata() for line in axes.lines if line.get_linestyle() == ":"]
        assert [list(x) for x in dotted] == [[100, 100]], "one line for attempts 2 and 3"
        assert [text.get_text() for text in axes.texts] == [" attempts 2, 3"]
    assert mark_texts([(2, 100), (3, 180)]) == [" attempt 2", "attempt 3 "], "the last at the edge"


def mark_texts(resumes: list[tuple[int, int]]) -> list[str]:
    figure = Figure()
    axes = figure.add_subplot(1, 1, 1)
    mark_attempts(axes, resumes)
    return [text.get_text() for text in axes.texts]


def test_names_of_attempts_that_resumed_close_together_do_not_cover_each_other() -> None:
    """Attempts 2 and 3 resumed 5 steps apart on a 1,000-step panel (a stop, then a crash
    soon after the resume): their names go on rows of their own, inside the band above the
    readings; a third name far away goes back to the top row."""
    figure = Figure(figsize=(5.5, 4.2))
    axes = figure.add_subplot(1, 1, 1)
    axes.plot([0, 1000], [0.0, 100.0])
    axes.set_ylim(0, with_headroom(100.0))
    mark_attempts(axes, [(2, 615), (3, 620), (4, 90)])
    figure.canvas.draw()
    names = {text.get_text().strip(): text for text in axes.texts}
    boxes = {name: text.get_window_extent() for name, text in names.items()}
    assert not boxes["attempt 2"].overlaps(boxes["attempt 3"]), "close names on rows of their own"
    assert names["attempt 4"].get_position()[1] == names["attempt 2"].get_position()[1]
    top_reading = axes.transData.transform((0, 100.0))[1]
    assert all(box.y0 >= top_reading for box in boxes.values()), "inside the band"
    assert name_rows([10, 12, 14, 16], 0, 100) == [0, 1, 2, 0], "past 3, the farthest row"
    # A name near the right edge sits to the left of its line: 25 steps from one to its left
    # still covers it.
    assert name_rows([60, 85], 0, 100) == [0, 1]
    assert name_rows([40, 85], 0, 100) == [0, 0]


def test_a_panel_that_ends_before_an_attempt_began_reaches_its_line_and_names_it_inside() -> None:
    """A panel whose data ends before the step a later attempt resumed from (its last
    interval closed earlier) still shows that attempt's line, named inside the panel."""
    figure = Figure()
    axes = figure.add_subplot(1, 1, 1)
    axes.plot([0, 440], [1.0, 2.0])
    mark_attempts(axes, [(2, 448)])
    assert axes.get_xlim()[1] >= 448, "the line is inside the panel's step range"
    (name,) = axes.texts
    assert (name.get_text(), name.get_horizontalalignment()) == ("attempt 2 ", "right")
    figure.canvas.draw()
    inside = axes.get_window_extent().x1 - name.get_window_extent().x1
    assert inside >= 0, "the name ends inside the panel"


def test_a_damaged_resume_step_is_passed_over(tmp_path: Path) -> None:
    attempts: list[dict[str, Any]] = [
        {"from_step": 0}, {"from_step": float("nan")}, {"from_step": 1e400},
        {"from_step": 12.5}, {"from_step": True}, {"from_step": 40},
    ]  # fmt: skip
    run_dir = run_with(tmp_path, attempts)
    assert resume_steps(run_dir) == [(6, 40)]


def test_a_machines_line_is_broken_where_another_attempt_took_over() -> None:
    """The machines between two attempts were not the job's: no line joins their readings."""
    steps, values = broken_at([10.0, 20.0, 30.0, 40.0], [50.0, 60.0, 70.0, 80.0], [25])
    assert steps == [10.0, 20.0, 25.0, 30.0, 40.0]
    assert values[:2] + values[3:] == [50.0, 60.0, 70.0, 80.0] and math.isnan(values[2])
    figure = Figure()
    axes = figure.add_subplot(1, 1, 1)
    draw_usage(axes, "CPU", {"node1": ([10.0, 20.0, 30.0], [5.0, 6.0, 7.0])}, [25])
    (line,) = axes.lines
    heights = np.asarray(line.get_ydata(), dtype=float)
    assert bool(np.isnan(heights[2])), "the line stops at step 25 and starts again"


def test_the_machines_and_step_time_readings_stay_below_the_attempts_names(tmp_path: Path) -> None:
    """A host's CPU near 200 % in attempt 2 was drawn on the panel's top edge, under the
    frame and the name "attempt 2": every reading must sit below the band kept for the names."""
    figure = plotted_over_three_attempts(
        tmp_path,
        lambda step: {"system/node1/cpu_percent": 186.8 if step <= 100 else 194.1,
                      "interval/data_wait_percent": 10.0, "interval/forward_percent": 30.0,
                      "interval/checkpoint_percent": 1.0},
    )  # fmt: skip
    assert [axes.get_title() for axes in figure.axes] == [
        "CPU of each host (%, 100 = one core)",
        "where each interval's time went (%, the ranks' mean)",
    ]  # fmt: skip
    for axes, highest in zip(figure.axes, (194.1, 100.0), strict=True):
        bottom, top = axes.get_ylim()
        assert bottom == 0 and highest <= (1 - HEADROOM) * top + 1e-9, axes.get_title()
        assert [text.get_text() for text in axes.texts] == [" attempts 2, 3"]
