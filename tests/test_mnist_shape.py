"""pytorch/examples' mnist/main.py, a script written for one GPU, converted as
docs/converting.md shows (tests/programs/mnist_shape.py): on 2 ranks it prints once, shards
its data (no warning of a DataLoader that gives every rank all of it), logs its test loop's
means over the whole test set, and stopped mid-epoch and rerun it ends bitwise where the
uninterrupted run does, its StepLR's learning rate included. Real local gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.runtime.errors import EXIT_STOPPED
from hpc_ddp.runtime.tracking.record import read_metrics
from hpc_ddp.view.runs import find_runs
from tests.helpers import REPO, run_local_program, summary_path

pytestmark = pytest.mark.e2e

PROGRAM = str(REPO / "tests" / "programs" / "mnist_shape.py")


def result_of(output: str) -> dict[str, Any]:
    [line] = [line for line in output.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))  # type: ignore[no-any-return]


def test_the_converted_mnist_script_logs_exact_test_means_and_resumes_bitwise(
    tmp_path: Path,
) -> None:
    def run(run_id: str, *settings: str) -> Any:
        given = [f"run.output_dir={tmp_path}", "tracking.enabled=false", f"run.id={run_id}"]
        words = [word for setting in [*given, *settings] for word in ("--set", setting)]
        return run_local_program(2, [*words, PROGRAM, "--epochs", "2"])

    reference = run("reference")
    assert reference.returncode == 0, reference.stderr[-3000:]
    # 1500 training digits, global batch 64: 23 steps an epoch, a log line every 10.
    train_lines = [line for line in reference.stdout.splitlines() if line.startswith("Train")]
    assert [line.split(" [")[0] for line in train_lines] == ["Train Epoch: 1"] * 3 + [
        "Train Epoch: 2"
    ] * 3, "printed by rank 0 alone"
    assert "[0/1500 (0%)]" in train_lines[0], "len(train_loader.dataset): the whole dataset"
    assert "reads all" not in reference.stderr and "left by a break" not in reference.stderr

    record = summary_path(tmp_path, "mnist_shape", "reference").parent
    tested = [(row["step"], row["metrics"]["test_accuracy"]) for row in read_metrics(record)
              if "test_accuracy" in row.get("metrics", {})]  # fmt: skip
    assert [step for step, _ in tested] == [23, 46]
    for _step, accuracy in tested:  # a share of the 297 test digits, each counted once
        assert accuracy * 297 == pytest.approx(round(accuracy * 297), abs=1e-6)
    [listed] = [found for found in find_runs(tmp_path) if found.run_id == "reference"]
    assert set(listed.val) == {"test_accuracy", "test_loss"} and set(listed.train) == {"loss"}

    stopped = run("resumed", "preempt.stop_at_step=30")
    assert stopped.returncode == EXIT_STOPPED, stopped.stderr[-3000:]
    resumed = run("resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, actual = result_of(reference.stdout), result_of(resumed.stdout)
    assert actual == expected and expected["lr"] == pytest.approx(0.49), "StepLR decayed twice"
