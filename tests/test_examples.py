"""The examples in examples/ on real local gloo ranks: each trains to its stated threshold on
2 ranks, reaches the same weights at 1 and 2 ranks (same global batch), and resumes from a
stop mid-epoch (the warning signal's, rehearsed at a step) to weights bitwise equal to an
uninterrupted run. The plain tutorial
script runs under torchrun too. The Slurm side is in test_slurm_examples.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hpc_ddp.runtime.errors import EXIT_STOPPED
from hpc_ddp.runtime.tracking.record import read_metrics
from hpc_ddp.view.runs import load_run
from tests.examples import CNN, LM, TUTORIAL, Example, run_dir, settings
from tests.helpers import REPO, clean_environ, read_summary, run_local_program
from tests.records import final_weights

QUIET = ("tracking.enabled=false", "preempt.check_every_steps=1")
#: What the language model's sample is worth: its 32-token context, and FLOPs against a
#: peak given for the CPU (no table has one), so its MFU is logged too.
LM_WORTH = (
    "monitor.tokens_per_sample=32", "monitor.flops_per_sample=4e6", "monitor.peak_tflops=0.01"
)  # fmt: skip


def quiet(example: Example) -> tuple[str, ...]:
    return (*QUIET, *LM_WORTH) if example is LM else QUIET


def arguments(example: Example, nproc: int, output: Path) -> list[str]:
    """The example's test arguments at ``nproc`` ranks, keeping the global batch at 32."""
    args = example.command()
    if example is TUTORIAL:  # its batch is per rank, as in the plain script
        args[args.index("--batch_size") + 1] = str(32 // nproc)
        args += ["--snapshot_path", str(output / f"snapshot-{nproc}.pt")]
    return args


def run_example(example: Example, nproc: int, output: Path, run_id: str) -> str:
    environment = clean_environ(**settings(output, run_id, *quiet(example)))
    result = run_local_program(nproc, arguments(example, nproc, output), environment=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def result_line(stdout: str) -> dict[str, Any]:
    [line] = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))  # type: ignore[no-any-return]


class Runs:
    """One example at 1 and 2 ranks, and 2 ranks stopped mid-epoch and run again."""

    def __init__(self, example: Example, output: Path) -> None:
        self.example, self.output = example, output
        self.stdout = {
            run_id: run_example(example, n, output, run_id) for n, run_id in ((1, "w1"), (2, "w2"))
        }
        self.stop_log = stop_mid_epoch(example, output, "stopped")
        self.stdout["stopped"] = run_example(example, 2, output, "stopped")


#: The step each example is stopped after, mid-epoch (preempt.stop_at_step: the warning
#: signal's stop, at a step known whatever the machine's pace).
STOP_AT = {"lm": 45, "digits_cnn": 100, "tutorial": 200}


def stop_mid_epoch(example: Example, output: Path, run_id: str) -> str:
    """2 ranks stopped as by the warning signal after :data:`STOP_AT`; the whole log."""
    environment = clean_environ(
        **settings(output, run_id, *quiet(example), f"preempt.stop_at_step={STOP_AT[example.name]}")
    )
    result = run_local_program(2, arguments(example, 2, output), environment=environment)
    log = result.stdout + result.stderr
    assert result.returncode == EXIT_STOPPED, log[-3000:]
    return log


@pytest.fixture(scope="module", params=[LM, CNN, TUTORIAL], ids=lambda example: example.name)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(request.param, tmp_path_factory.mktemp(request.param.name))


@pytest.mark.e2e
def test_two_ranks_train_to_the_stated_threshold(runs: Runs) -> None:
    example, output = runs.example, runs.output
    metric, bound = example.target
    if example is TUTORIAL:  # no summary of its own: its epoch metric, from the run's record
        epochs = [entry["metrics"] for entry in read_metrics(run_dir(output, example, "w2"))]
        per_epoch = [values[metric] for values in epochs if metric in values]
        assert len(per_epoch) == 4 and per_epoch[-1] < per_epoch[0] / 20, per_epoch
        value = per_epoch[-1]
    else:
        value = read_summary(output, example.name, "w2")[metric]
    assert value > bound if metric.endswith("accuracy") else value < bound, (metric, value)
    if example is LM:  # what its samples/s is worth, from the monitor settings
        intervals = [entry["metrics"] for entry in read_metrics(run_dir(output, example, "w2"))
                     if "interval/samples_per_s" in entry["metrics"]]  # fmt: skip
        assert len(intervals) > 5
        for metrics in intervals:
            samples_per_s = metrics["interval/samples_per_s"]
            assert metrics["interval/tokens_per_s"] == pytest.approx(32 * samples_per_s)
            assert metrics["interval/tflops"] == pytest.approx(4e6 * samples_per_s / 1e12)
            mfu = 100 * metrics["interval/tflops"] / (0.01 * 2)
            assert metrics["interval/mfu_percent"] == pytest.approx(mfu)


@pytest.mark.e2e
def test_one_and_two_ranks_reach_the_same_weights(runs: Runs) -> None:
    one = final_weights(runs.output, runs.example.name, "w1")
    two = final_weights(runs.output, runs.example.name, "w2")
    assert one.keys() == two.keys()
    # Summing a batch in one piece or in two differs in float32's last bits; training grows
    # that: AdamW (which divides each step by the gradient's running scale) to about 1e-3 in
    # 230 steps, SGD with momentum through convolutions to about 1e-4 in 280 steps.
    atol = {"lm": 5e-3, "digits_cnn": 5e-4}.get(runs.example.name, 1e-5)
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-2, atol=atol)
    if runs.example is not TUTORIAL:
        w1, w2 = result_line(runs.stdout["w1"]), result_line(runs.stdout["w2"])
        assert w1["global_step"] == w2["global_step"]
        count = "val_tokens" if runs.example is LM else "val_count"
        assert w1[count] == w2[count], "every held-out item counted once at any world size"


@pytest.mark.e2e
def test_a_stop_mid_epoch_and_a_rerun_give_bitwise_the_uninterrupted_weights(runs: Runs) -> None:
    stop_step = int(re.search(r"checkpoint \(stop signal\) step (\d+)", runs.stop_log).group(1))  # type: ignore[union-attr]
    reference = read_summary(runs.output, runs.example.name, "w2")
    resumed = read_summary(runs.output, runs.example.name, "stopped")
    assert stop_step == STOP_AT[runs.example.name] < reference["global_step"]
    assert resumed["resumed_from_step"] == stop_step
    assert resumed["weights_sha256"] == reference["weights_sha256"], "bitwise equal"
    assert resumed["global_step"] == reference["global_step"]
    if runs.example is not TUTORIAL:
        resumed_result, reference_result = (
            {key: value for key, value in result_line(runs.stdout[run_id]).items()
             if key != "tokens_per_s"}  # a speed, not a result
            for run_id in ("stopped", "w2")
        )  # fmt: skip
        assert resumed_result == reference_result
    record = load_run(run_dir(runs.output, runs.example, "stopped"))
    assert record is not None and (record.state, record.attempts) == ("finished", 2)


@pytest.mark.e2e
def test_the_digits_confusion_counts_every_held_out_image_once(tmp_path: Path) -> None:
    stdout = run_example(CNN, 2, tmp_path, "c")
    confusion = torch.tensor(read_summary(tmp_path, CNN.name, "c")["confusion"])
    assert confusion.shape == (10, 10) and int(confusion.sum()) == 300
    accuracy = result_line(stdout)["val_accuracy"]
    assert int(confusion.trace()) == round(accuracy * 300), "the diagonal is the accuracy"
    assert "confusion (rows: true digit, columns: predicted):" in stdout


#: What torch 2.13 prints when a gloo rank aborts in the interpreter's teardown, after the
#: script's last line: a gloo worker thread drops the last backward's all-reduce, whose saved
#: thread-local state holds a Python object, while the interpreter is finalizing
#: (pytorch/pytorch#190489). The plain script frees its DDP model first, so it never does.
TEARDOWN_ABORT = "terminate called without an active exception"


def run_plain_tutorial(snapshot: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(REPO / "examples/tutorial/plain_ddp.py"), "4", "2", "--snapshot_path", str(snapshot)],
        cwd=snapshot.parent, env=clean_environ(), capture_output=True, text=True, timeout=240,
        check=False,
    )  # fmt: skip


@pytest.mark.e2e
def test_the_plain_tutorial_script_runs_under_torchrun(tmp_path: Path) -> None:
    """The "before" of the README's diff, as its users run it: it trains, its snapshot is the
    one its code promises, and it ends cleanly (exit 0, no abort at the interpreter's exit)."""
    result = run_plain_tutorial(tmp_path / "snapshot.pt")
    assert result.returncode == 0 and TEARDOWN_ABORT not in result.stderr, result.stderr[-3000:]
    pattern = r"\[rank 0\] epoch \d \| last batch loss (\d+\.\d{6})"
    losses = [float(x) for x in re.findall(pattern, result.stdout)]
    assert len(losses) == 4 and losses[-1] < 0.05, result.stdout
    snapshot = torch.load(tmp_path / "snapshot.pt", weights_only=True)
    assert snapshot["EPOCHS_RUN"] == 3, "saved after epochs 0 and 2 (every 2)"


def test_the_tutorial_diff_is_as_small_as_the_readme_says() -> None:
    """README.md's count of the lines the conversion adds or changes, kept true."""
    plain = (REPO / "examples/tutorial/plain_ddp.py").read_text().splitlines()
    converted = (REPO / "examples/tutorial/with_hpc_ddp.py").read_text().splitlines()
    added = [line for line in converted if line.strip() and line not in plain]
    removed = [line for line in plain if line.strip() and line not in converted]
    readme = (REPO / "examples/tutorial/README.md").read_text()
    assert f"{len(added)} lines added or changed, {len(removed)} removed" in readme
    assert len(added) <= 12


@pytest.mark.slow
@pytest.mark.e2e
def test_the_language_model_compiled_trains_like_the_eager_one(tmp_path: Path) -> None:
    """--compile: torch.compile over the DDP-wrapped model (inductor, C++ on the CPU). Slow:
    inductor compiles C++ for 40 s; the eager run's exactness is pinned by the tests above."""
    results = {}
    for run_id, extra in (("eager", []), ("compiled", ["--compile"])):
        environment = clean_environ(**settings(tmp_path, run_id, *QUIET))
        args = [*LM.command("--epochs", "1"), *extra]
        result = run_local_program(2, args, timeout=600, environment=environment)
        assert result.returncode == 0, result.stderr[-3000:]
        results[run_id] = result_line(result.stdout)
    eager, compiled = results["eager"], results["compiled"]
    assert compiled["global_step"] == eager["global_step"] == 117
    assert compiled["val_tokens"] == eager["val_tokens"]
    assert compiled["val_loss"] == pytest.approx(eager["val_loss"], rel=0.02)
    assert compiled["val_loss"] < 4.0, "it learned (from ln 256 = 5.55)"
