"""Three training programs that are not shaped like the DDP tutorial, each written only
against the public API (tests/programs/): an iteration-based LM loop with its own random
``get_batch`` (nanoGPT's shape), a ``torch.multiprocessing.spawn`` script started by
``hpc_ddp.spawn`` from plain python, and a DataLoader with the user's own sampler. Each trains
to the same weights at 1 and 2 ranks where it is deterministic, and a SIGUSR1 mid-run plus a
rerun ends bitwise equal to an uninterrupted run, in one MLflow run. Real local gloo ranks."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from mlflow import MlflowClient

from hpc_ddp.runtime.checkpoint.files import list_checkpoints, load_checkpoint
from hpc_ddp.runtime.errors import EXIT_STOPPED
from hpc_ddp.runtime.tracking.base import default_tracking_uri
from tests.helpers import REPO, clean_environ, run_local_program, signal_after
from tests.records import final_weights

pytestmark = pytest.mark.e2e  # every test here starts processes

LM = str(REPO / "tests" / "programs" / "lm_loop.py")
SPAWN = str(REPO / "tests" / "programs" / "spawn_script.py")
SAMPLER = str(REPO / "tests" / "programs" / "own_sampler.py")


def launch(program: str, nproc: int, arguments: list[str]) -> list[str]:
    """The command that starts ``program`` on ``nproc`` ranks: the spawn script starts its
    ranks itself from plain python; the others go through `hpc-ddp local`."""
    if program == SPAWN:
        return [sys.executable, SPAWN, "--world-size", str(nproc), *arguments]
    return [sys.executable, "-m", "hpc_ddp", "local", "--nproc", str(nproc), program, *arguments]


def run_program(program: str, nproc: int, arguments: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        launch(program, nproc, arguments),
        cwd=REPO,
        env=clean_environ(),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def result_of(output: str) -> dict[str, Any]:
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, output[-2000:]
    return json.loads(lines[0].removeprefix("RESULT "))  # type: ignore[no-any-return]


DETERMINISTIC = {
    "lm": (LM, ["--max-iters", "60", "--sampling", "global", "--dropout", "0"]),
    "spawn": (SPAWN, ["--epochs", "2"]),
    "sampler": (SAMPLER, ["--epochs", "2"]),
}


@pytest.mark.parametrize("shape", sorted(DETERMINISTIC))
def test_one_and_two_ranks_train_to_the_same_weights(shape: str, tmp_path: Path) -> None:
    program, arguments = DETERMINISTIC[shape]
    finals = {}
    for nproc in (1, 2):
        output = tmp_path / f"w{nproc}"
        settings = [f"run.output_dir={output}", "tracking.enabled=false"]
        result = run_program(program, nproc, [*arguments, *settings])
        assert result.returncode == 0, result.stderr[-3000:]
        facts = result_of(result.stdout)
        assert json.loads(next(output.glob("*/*/summary.json")).read_text())["world_size"] == nproc
        finals[nproc] = (facts, final_weights(output))
    (one, one_model), (two, two_model) = finals[1], finals[2]
    assert one["global_step"] == two["global_step"] > 0
    for key, value in one_model.items():
        torch.testing.assert_close(two_model[key], value, rtol=1e-4, atol=1e-5)


#: Each shape's arguments, how its first attempt is stopped and where, and its steps. The
#: spawn script's ranks get SIGUSR1 through hpc_ddp.spawn, held at step 40 until it reached
#: them; the others stop at a step as on the warning signal (preempt.stop_at_step).
RESUMED = {
    # nanoGPT's sampling from each rank's own random stream, and dropout: the restored
    # streams carry both on.
    "lm": (LM, ["--max-iters", "160"], ["preempt.stop_at_step=70"], 70, 160),
    "spawn": (SPAWN, ["--epochs", "3"], ["--hold-at-step", "40"], 41, 96),
    "sampler": (SAMPLER, ["--epochs", "2"], ["preempt.stop_at_step=25"], 25, 100),
}


@pytest.mark.parametrize("shape", sorted(RESUMED))
def test_stopped_mid_run_and_rerun_equals_uninterrupted_in_one_mlflow_run(
    shape: str, tmp_path: Path
) -> None:
    program, arguments, stopping, stop_step, steps = RESUMED[shape]
    common = [*arguments, f"run.output_dir={tmp_path}", "preempt.check_every_steps=1"]
    reference = run_program(program, 2, [*common, "run.id=reference"])
    assert reference.returncode == 0, reference.stderr[-3000:]

    process = subprocess.Popen(
        launch(program, 2, [*common, "run.id=stopped", *stopping]),
        cwd=REPO,
        env=clean_environ(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if program == SPAWN:
        log = signal_after(process, r"HOLDING at step 40 \(rank 0\)", signal.SIGUSR1)
    else:
        _out, log = process.communicate(timeout=240)
    assert process.returncode == EXIT_STOPPED, log[-3000:]
    assert f"checkpoint (stop signal) step {stop_step}:" in log, log[-3000:]

    rerun = run_program(program, 2, [*common, "run.id=stopped"])
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert re.search(rf"resumed from .* at step {stop_step} ", rerun.stderr)
    assert f"resuming the batches at step {stop_step}:" in rerun.stderr, "said once, how"
    expected, actual = result_of(reference.stdout), result_of(rerun.stdout)
    assert actual["global_step"] == expected["global_step"] == steps
    assert actual["weights_sha256"] == expected["weights_sha256"], "bitwise equal"

    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path))
    experiment = client.get_experiment_by_name("hpc_ddp")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 2, "one MLflow run per run.id: the stopped run and its rerun are one"
    summary = json.loads(next(tmp_path.glob("*/stopped/summary.json")).read_text())
    stopped = client.get_run(summary["mlflow_run_id"])
    assert stopped.info.status == "FINISHED"
    assert stopped.data.tags["hpc_ddp.attempts"] == "2"
    history = client.get_metric_history(stopped.info.run_id, "interval/loss")
    recorded = [point.step for point in history]
    assert recorded == sorted(set(recorded)), "no step logged twice"


def test_the_lm_loop_evaluates_once_per_interval_and_keeps_its_best_loss(tmp_path: Path) -> None:
    """run.every() fires at steps 0, 50, 100, 150 whatever the micro-steps; run.state keeps a
    plain float across the checkpoint."""
    best = tmp_path / "best.pt"
    arguments = ["--max-iters", "160", "--accum", "4", "--best", str(best)]
    result = run_local_program(2, [LM, *arguments, f"run.output_dir={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    facts = result_of(result.stdout)
    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path))
    experiment = client.get_experiment_by_name("hpc_ddp")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(run.info.run_id, "val_loss")
    assert [point.step for point in history] == [0, 50, 100, 150]
    assert facts["best_val_loss"] == pytest.approx(min(point.value for point in history))
    assert "interval/lr" in run.data.metrics and "lr" not in run.data.metrics
    (checkpoints,) = tmp_path.glob("*/*/checkpoints")
    saved = load_checkpoint(list_checkpoints(checkpoints)[0])
    assert saved["values"] == {"best_val_loss": facts["best_val_loss"]}
    assert best.is_file() and set(torch.load(best)) >= {"head.weight", "embed.weight"}


PER_RANK_FILES = """
import torch
import hpc_ddp
from torch.utils.data import DataLoader, TensorDataset

run = hpc_ddp.start(run={"name": "uneven"}, tracking={"enabled": False})
model = run.wrap(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
run.register(model=model, optimizer=optimizer)
# Each rank reads its own list of files, one rank's longer than the other's.
samples = TensorDataset(torch.randn(64 + 32 * run.rank, 4))
for epoch in run.epochs(1):
    for (features,) in run.steps(DataLoader(samples, batch_size=8)):
        model(features).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
run.finish()
"""


def test_ranks_with_datasets_of_different_lengths_are_refused_not_left_waiting(
    tmp_path: Path,
) -> None:
    (tmp_path / "uneven.py").write_text(PER_RANK_FILES)
    result = run_local_program(
        2, ["--set", f"run.output_dir={tmp_path}", str(tmp_path / "uneven.py")]
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "different numbers of steps per epoch (rank 0: 8, rank 1: 12)" in result.stderr
    assert "HINT: give every rank the same dataset" in result.stderr


def test_spawn_under_a_launcher_names_a_world_size_the_script_computed_apart(
    tmp_path: Path,
) -> None:
    """The classic script passes the number it computed (`--world-size`) to main; under a
    launcher the launcher's ranks run, and rank 0 says so once, with run.world_size."""
    common = [SPAWN, "--epochs", "1", "tracking.enabled=false", f"run.output_dir={tmp_path}"]
    runs = {
        asked: subprocess.run(
            [
                sys.executable,
                "-m",
                "hpc_ddp",
                "local",
                "--nproc",
                "2",
                common[0],
                "--world-size",
                str(asked),
                *common[1:],
                f"run.id=asked-{asked}",
            ],
            cwd=REPO,
            env=clean_environ(),
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        for asked in (3, 2)
    }
    for result in runs.values():
        assert result.returncode == 0, result.stderr[-3000:]
    warning = "hpc_ddp.spawn(..., nprocs=3) under a launcher that started 2 ranks"
    lines = [line for line in runs[3].stderr.splitlines() if warning in line]
    assert len(lines) == 1 and "[rank 0/2] WARNING" in lines[0], runs[3].stderr[-3000:]
    assert "HINT: inside main use run.world_size (here 2)" in lines[0]
    assert "nprocs=" not in runs[2].stderr, "no warning where they agree"
