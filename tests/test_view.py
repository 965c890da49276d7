"""`hpc-ddp runs` and `hpc-ddp plot`: the run's own record (status.json, metrics.jsonl) as a
real run writes it, listed and drawn without MLflow or a server."""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.image import imread

from hpc_ddp.cli import results
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.tracking.base import NullTracker
from hpc_ddp.runtime.tracking.journal import JournalTracker
from hpc_ddp.runtime.tracking.record import read_status
from hpc_ddp.view.plot import base_name, curves, plot_run
from hpc_ddp.view.runs import find_run, find_runs, format_runs, load_run, metric_kind
from hpc_ddp.view.steptime import interval_starts
from tests.helpers import REPO, clean_environ, run_local_program

PROGRAM = str(REPO / "tests" / "programs" / "regression.py")


def hpc_ddp_command(*args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    cli = "import sys; from hpc_ddp.cli import main; sys.exit(main(sys.argv[1:]))"
    code = f"{prelude or 'pass'}; {cli}"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env=clean_environ(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("interval/loss", "train"),
        ("accuracy", "train"),
        ("val_loss", "val"),
        ("interval/val/accuracy", "val"),
        ("eval_bleu", "val"),
        ("test_loss", "val"),  # pytorch/examples' MNIST names its held-out metrics so
        ("test_accuracy", "val"),
        ("validation_loss", "val"),
        ("valid_f1", "val"),
        ("value_loss", "train"),  # a reinforcement learner's, not a split's
        ("testing_time", "train"),
        ("interval/samples_per_s", None),
    ],
)
def test_a_held_out_splits_metrics_are_told_from_training_ones(name: str, kind: str | None) -> None:
    assert metric_kind(name) == kind


def test_a_metric_and_its_held_out_twin_share_a_curve_name() -> None:
    names = ["loss", "val_loss", "test_loss", "eval/loss", "train_loss (epoch)", "valid_loss"]
    assert {base_name(name) for name in names} == {"loss"}
    assert base_name("value_loss") == "value_loss"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("runs")
    program = [PROGRAM, "--epochs", "2", "--log-interval", "10", f"run.output_dir={output}"]
    result = run_local_program(2, [*program, "run.id=first", "tracking.enabled=false"])
    assert result.returncode == 0, result.stderr[-2000:]
    return output


@pytest.mark.e2e
def test_runs_lists_a_finished_run_with_its_step_and_newest_metrics(finished_run: Path) -> None:
    summary = json.loads((finished_run / "regression" / "first" / "summary.json").read_text())
    [run] = find_runs(finished_run)
    assert (run.name, run.run_id, run.state, run.attempts) == ("regression", "first", "finished", 1)
    assert (run.global_step, run.epoch) == (100, 2)
    assert run.val == {"val_mse": summary["val_mse"]}
    assert set(run.train) == {"mse"}, "speed and learning rate are not training metrics"

    listed = hpc_ddp_command("runs", str(finished_run))
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split() == [
        "RUN",
        "STATE",
        "STEP",
        "EPOCH",
        "ATTEMPTS",
        "GOODPUT",
        "UPDATED",
        "TRAIN",
        "VAL",
    ]
    goodput = f"{summary['time_account']['goodput_percent']:.0f}%"
    assert row.split()[:6] == ["regression/first", "finished", "100", "2", "1", goodput]
    assert f"val_mse={summary['val_mse']:.4g}" in row


@pytest.mark.e2e
def test_plot_writes_a_png_with_the_training_and_validation_curves(
    finished_run: Path, tmp_path: Path
) -> None:
    figure = plot_run(find_run("regression/first", finished_run))
    # regression: losses, no score panel; then the machines (a real run records its host's
    # CPU) and where each interval's time went
    losses, machines, parts = figure.axes
    assert machines.get_title() == "CPU of each host (%, 100 = one core)"
    assert parts.get_title() == "where each interval's time went (%, the ranks' mean)"
    assert losses.get_title() == "losses" and losses.get_yscale() == "log"
    lines = {line.get_label(): line for line in losses.get_lines()}
    assert set(lines) == {"mse", "mse (epoch)", "val_mse"}
    assert list(lines["mse"].get_xdata()) == list(range(10, 101, 10)), "one point per interval"
    assert list(lines["mse (epoch)"].get_xdata()) == [50, 100], "one point per epoch"
    assert list(lines["val_mse"].get_xdata()) == [50, 100]
    assert len({line.get_color() for line in lines.values()}) == 1, "one colour per metric"
    assert lines["mse (epoch)"].get_zorder() > lines["mse"].get_zorder(), "dots over the line"
    assert lines["mse"].get_ydata()[-1] < lines["mse"].get_ydata()[0], "the loss fell"

    png = tmp_path / "curves.png"
    written = hpc_ddp_command("plot", "first", "--output-dir", str(finished_run), "-o", str(png))
    assert written.returncode == 0, written.stderr
    assert written.stdout.strip() == str(png)
    pixels = imread(png)
    assert pixels.shape[:2] == (420, 1650), "3 panels of 5.5 x 4.2 inches at 100 dpi"
    assert pixels[..., :3].std() > 0.05, "something is drawn"


@pytest.mark.e2e
def test_plot_without_matplotlib_says_how_to_install_it(finished_run: Path) -> None:
    """matplotlib is installed here: the import is made to fail, as on a machine without it."""
    result = hpc_ddp_command(
        "plot",
        str(finished_run / "regression" / "first"),
        prelude="import sys; sys.modules['matplotlib'] = None",
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "hpc-ddp plot: error: hpc-ddp plot needs matplotlib, which is not installed\n"
        'HINT: pip install matplotlib (or pip install "hpc_ddp[plot]")'
    )


@pytest.mark.e2e
def test_a_missing_run_or_directory_is_one_line(tmp_path: Path) -> None:
    missing = hpc_ddp_command("runs", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "no such directory" in missing.stderr
    assert "Traceback" not in missing.stderr
    unknown = hpc_ddp_command("plot", "nope", "--output-dir", str(tmp_path))
    assert unknown.returncode == 2 and "no run 'nope'" in unknown.stderr
    assert "Traceback" not in unknown.stderr


def test_a_run_name_alone_lists_its_runs_newest_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hpc-ddp plot main` where main/ holds several runs: they are named, not 'no run';
    `hpc-ddp runs main` lists them."""
    monkeypatch.chdir(tmp_path)
    runs = Path("runs")
    for name, run_id in (("main", "first"), ("main", "second"), ("other", "third")):
        journal = JournalTracker(NullTracker(), runs / name / run_id, lambda: (0, 0), "", 1, None)
        journal.finish("FINISHED")
    with pytest.raises(HpcDdpError) as named:
        find_run("main", runs)
    assert named.value.message == (
        "'main' is a run name with 2 run(s) in runs, newest first: main/second, main/first"
    )
    assert named.value.hint.startswith("give one as NAME/ID, e.g. main/second")
    assert find_run("main/first", runs).run_id == "first"
    assert results.runs(argparse.Namespace(output_dir="main")) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert listed == ["main/second", "main/first"]


def test_the_record_follows_every_way_a_run_ends(tmp_path: Path) -> None:
    run_dir = tmp_path / "name" / "id"
    position = [0, 0]

    def journal() -> JournalTracker:
        return JournalTracker(NullTracker(), run_dir, lambda: (position[0], position[1]), "7", 4)

    first = journal()
    assert read_status(run_dir)["state"] == "running"  # type: ignore[index]
    position[:] = [40, 1]
    first.log_metrics({"interval/loss": 2.0, "val_loss": float("nan")}, 40)
    first.suspend()
    assert load_run(run_dir).state == "requeued"  # type: ignore[union-attr]
    second = journal()
    second.finish("KILLED")
    status = load_run(run_dir)
    assert status is not None and (status.state, status.attempts) == ("stopped", 2)
    assert status.val == {"val_loss": None}, "NaN is stored as null: strict JSON"
    journal().finish("FAILED")
    assert load_run(run_dir).state == "failed"  # type: ignore[union-attr]
    journal().finish("FINISHED")
    assert load_run(run_dir).attempts == 4  # type: ignore[union-attr]


@pytest.mark.e2e
def test_a_run_whose_process_is_gone_is_listed_as_lost(tmp_path: Path) -> None:
    """A rank killed with SIGKILL cannot write its end: the record's pid tells."""
    run_dir = tmp_path / "name" / "id"
    JournalTracker(NullTracker(), run_dir, lambda: (3, 0), "7", 1)
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    status = json.loads((run_dir / "status.json").read_text())
    (run_dir / "status.json").write_text(json.dumps({**status, "pid": int(gone.stdout)}))
    assert load_run(run_dir).state == "lost"  # type: ignore[union-attr]
    assert "lost" in format_runs(find_runs(tmp_path))


def test_summaries_are_strict_json_even_with_a_metric_over_nothing(tmp_path: Path) -> None:
    from hpc_ddp.runtime.session.finishing import write_summary

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    path = write_summary(tmp_path, {"val_loss": float("nan"), "rows": [1.0, float("inf")]})
    assert json.loads(path.read_text(), parse_constant=refuse) == {
        "val_loss": None,
        "rows": [1.0, None],
    }


def test_plot_puts_scores_on_their_own_axis_and_keeps_each_metrics_colour(tmp_path: Path) -> None:
    """A record as the built-in trainer writes it (train_loss per interval and epoch,
    val_loss and val_accuracy per epoch): losses on a log axis, the accuracy apart, and
    train_loss and val_loss in one colour."""
    run_dir = tmp_path / "digits" / "a"
    journal = JournalTracker(NullTracker(), run_dir, lambda: (0, 0), "job", 1, None)
    for step in (10, 20, 30, 40):
        journal.log_metrics({"interval/train_loss": 2.0 / step}, step)
    journal.finish("FINISHED")
    entries = [
        {"step": 20, "global_step": 20, "epoch": 1, "metrics": {"train_loss": 0.1}},
        {
            "step": 20,
            "global_step": 20,
            "epoch": 1,
            "metrics": {"val_loss": 0.2, "val_accuracy": 0.9},
        },
        {"step": 40, "global_step": 40, "epoch": 2, "metrics": {"train_loss": 0.05}},
        {
            "step": 40,
            "global_step": 40,
            "epoch": 2,
            "metrics": {"val_loss": 0.1, "val_accuracy": 0.95},
        },
    ]
    with (run_dir / "metrics.jsonl").open("a") as record:
        record.writelines(json.dumps(entry) + "\n" for entry in entries)
    losses, scores = plot_run(find_run("digits/a", tmp_path)).axes
    assert (losses.get_title(), losses.get_yscale()) == ("losses", "log")
    assert (scores.get_title(), scores.get_yscale()) == ("scores", "linear")
    loss_lines = {line.get_label(): line for line in losses.get_lines()}
    assert set(loss_lines) == {"train_loss", "train_loss (epoch)", "val_loss"}
    assert len({line.get_color() for line in loss_lines.values()}) == 1
    [accuracy] = scores.get_lines()
    assert accuracy.get_label() == "val_accuracy" and list(accuracy.get_xdata()) == [20, 40]


@pytest.mark.parametrize(
    "damage",
    [
        {"global_step": "abc"},
        {"attempts": None},
        {"epoch": -3},
        {"pid": "x", "state": "running"},
        {"updated": "yesterday"},
    ],
    ids=["step-text", "attempts-null", "epoch-negative", "pid-text", "updated-text"],
)
@pytest.mark.e2e
def test_a_damaged_record_is_one_line_and_every_other_run_still_lists(
    tmp_path: Path, damage: dict[str, object]
) -> None:
    for run_id in ("good", "damaged"):
        journal = JournalTracker(NullTracker(), tmp_path / "name" / run_id, lambda: (3, 0), "7", 1)
        journal.log_metrics({"loss": 0.5}, 3)
        journal.flush()
    status_file = tmp_path / "name" / "damaged" / "status.json"
    status_file.write_text(json.dumps({**json.loads(status_file.read_text()), **damage}))
    result = hpc_ddp_command("runs", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "good" in result.stdout and "Traceback" not in result.stderr
    listed = "damaged" in result.stdout
    skipped = [line for line in result.stderr.splitlines() if "skipped" in line]
    assert listed != bool(skipped), "the damaged run is listed (a harmless field) or named once"
    if skipped:
        assert len(skipped) == 1 and str(status_file) in skipped[0], result.stderr


@pytest.mark.e2e
def test_damaged_lines_of_metrics_jsonl_are_left_out_of_runs_plot_and_sync(tmp_path: Path) -> None:
    run_dir = tmp_path / "name" / "id"
    journal = JournalTracker(NullTracker(), run_dir, lambda: (3, 0), "7", 1)
    journal.log_metrics({"loss": 0.5, "val_accuracy": 0.75}, 3)
    journal.flush()
    with (run_dir / "metrics.jsonl").open("a") as record:
        for damaged in (
            {"step": "x", "global_step": 4, "epoch": 0, "time": 1.0, "metrics": {"loss": 1.0}},
            {"step": 5, "global_step": 5, "epoch": 0, "time": 1.0, "metrics": {"loss": "high"}},
            {"step": 6, "global_step": 6, "epoch": 0, "time": "t", "metrics": {"loss": 2.0}},
            [1, 2, 3],
        ):
            record.write(json.dumps(damaged) + "\n")
    run = load_run(run_dir)
    assert run is not None and run.train == {"loss": 0.5} and run.val == {"val_accuracy": 0.75}
    train, val = curves(run_dir)
    assert train == {"loss (epoch)": ([3.0], [0.5])} and val == {"val_accuracy": ([3.0], [0.75])}
    plotted = hpc_ddp_command("plot", "name/id", "--output-dir", str(tmp_path))
    assert plotted.returncode == 0 and "Traceback" not in plotted.stderr, plotted.stderr


@pytest.mark.parametrize("store", ["ftp://nowhere", "damaged-sqlite"])
@pytest.mark.e2e  # MLflow starts a process as it opens a store
def test_tracking_sync_into_a_store_that_cannot_open_is_one_line(
    tmp_path: Path, store: str
) -> None:
    """An unknown URI scheme, or a SQLite file that is no database: MLflow's client fails
    as it is made, which is one line naming the store, as any other failure of the sync."""
    from hpc_ddp.runtime.tracking.sync import sync_run

    run_dir = tmp_path / "name" / "id"
    journal = JournalTracker(NullTracker(), run_dir, lambda: (3, 0), "7", 1)
    journal.log_metrics({"loss": 0.5}, 3)
    journal.flush()
    (run_dir / "status.json").write_text(json.dumps({"state": "finished"}))
    (run_dir / "tracking.json").write_text(json.dumps({"uri": "sqlite:///unused.db"}))
    if store == "damaged-sqlite":
        (tmp_path / "damaged.db").write_text("not a database\n" * 10)
        store = f"sqlite:///{tmp_path / 'damaged.db'}"
    with pytest.raises(HpcDdpError, match=f"MLflow at {re.escape(store)} failed: "):
        sync_run(run_dir, store)


@pytest.mark.parametrize("output", ["curves.badext", "curves", "folder"])
def test_a_plot_to_a_file_matplotlib_cannot_write_is_one_line(tmp_path: Path, output: str) -> None:
    """An extension matplotlib has no writer for was its ValueError traceback; a directory
    or no extension was written as NAME.png while NAME was printed."""
    from hpc_ddp.view.plot import save_plot

    journal = JournalTracker(NullTracker(), tmp_path / "name" / "id", lambda: (3, 0), "7", 1)
    journal.log_metrics({"loss": 0.5}, 3)
    journal.flush()
    (tmp_path / "folder").mkdir()
    said = {
        "curves.badext": "extension '.badext'",
        "curves": "no extension",
        "folder": "a directory",
    }
    with pytest.raises(HpcDdpError, match=f"{said[output]}, expected a file name ending in one"):
        save_plot(find_run("name/id", tmp_path), tmp_path / output)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["folder", "name"]
    assert save_plot(find_run("name/id", tmp_path), tmp_path / "c.SVG").is_file()


RANK_1_RAISES = """
import os, signal, torch
import hpc_ddp


def check(step):
    if run.rank == 1 and step == 7:
        FAULT


run = hpc_ddp.start(tracking={"enabled": False})
model = run.wrap(torch.nn.Linear(2, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = run.train_loader(torch.randn(256, 2), batch_size=BATCH)
for epoch in run.epochs(2):
    for batch in run.steps(loader):
        check(run.global_step)
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
run.finish()
"""


RAISES = 'raise ValueError(f"bad label in batch {step}")'
KILLED = "os.kill(os.getpid(), signal.SIGKILL)"


@pytest.mark.parametrize(
    ("batch", "fault", "said"),
    [
        (
            16,
            RAISES,
            "attempt 1 failed at step 7: rank 1 on {host}: ValueError: bad label in batch 7, "
            "at {script}:8 in check; 1 other rank(s) ended after it",
        ),
        (
            16,
            KILLED,
            "attempt 1 failed at step 7: rank 1 left no line (killed outright: by SIGKILL, the "
            "out-of-memory killer or with its host; or stopped before it could write; the job's "
            "log says which), then "
            "rank 0 on {host}: another rank went away during a collective, at {script}:",
        ),
        (
            15,
            RAISES,
            "failed at step 0: rank {rank} on {host}: HpcDdpError: batch_size=15 "
            "(global) does not divide over world_size=2 x grad_accum_steps=1, at {script}:14 in "
            "<module>; 1 other rank(s) ended after it",
        ),
    ],
    ids=["one-rank-raises", "one-rank-killed", "refused-at-start"],
)
@pytest.mark.e2e
def test_runs_names_what_ended_a_failed_attempt(
    batch: int, fault: str, said: str, tmp_path: Path
) -> None:
    """A rank killed outright writes nothing: the rank that lost it does (it fails in its
    next collective, before the launcher's stop could reach it: a stop needs that rank too),
    and the killed rank is named as the one that left no line."""
    script = tmp_path / "fails.py"
    script.write_text(RANK_1_RAISES.replace("BATCH", str(batch)).replace("FAULT", fault))
    result = run_local_program(2, ["--set", f"run.output_dir={tmp_path}", str(script)])
    assert result.returncode in ((1, 2) if fault == RAISES else (-9, 137)), result.stderr[-3000:]
    [run_dir] = (tmp_path / "fails").iterdir()
    shown = hpc_ddp_command("runs", str(run_dir))
    assert shown.returncode == 0, shown.stderr
    [line] = [line for line in shown.stdout.splitlines() if " failed at step " in line]
    host = socket.gethostname()
    if fault == KILLED:  # rank 0 lost it in the gradients' all-reduce or the stop's
        assert line.strip().startswith(said.format(host=host, script=script)), line
    elif batch == 16:
        assert line.strip() == said.format(host=host, script=script)
    else:  # every rank refuses it before training, and the first to say so is named
        named = {said.format(rank=rank, host=host, script=script) for rank in (0, 1)}
        start, _, rest = line.strip().partition(" failed at step ")
        assert start.startswith("a start at ") and f"failed at step {rest}" in named, line


@pytest.mark.parametrize(
    ("steps", "resumes", "starts"),
    [
        ([20.0, 40.0], [], [0.0, 20.0]),
        # Stopped at 60 after the interval of step 20: steps 21-60 are in no interval.
        ([20.0, 80.0, 100.0], [60], [0.0, 60.0, 80.0]),
        # Crashed after step 12, resumed from 8 (the superseded interval of 12 left out).
        ([4.0, 8.0, 16.0], [8], [0.0, 4.0, 8.0]),
        # Two resumes between two intervals: the later one began it.
        ([10.0, 50.0], [20, 30], [0.0, 30.0]),
    ],
    ids=["one-attempt", "stopped-and-resumed", "crashed-and-redone", "two-resumes"],
)
def test_an_interval_after_a_resume_begins_at_the_resume(
    steps: list[float], resumes: list[int], starts: list[float]
) -> None:
    assert interval_starts(steps, resumes) == starts
