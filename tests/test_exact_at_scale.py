"""Stopped mid-epoch and resumed, a run ends bitwise where the uninterrupted one does at 3
and 4 ranks too, where a gradient's sum over the ranks depends on the order it is taken in
(at 1 and 2 ranks it cannot): for the model run.wrap builds, the DDP a script builds itself
and registers, and FSDP2 (of a model built on the meta device); and with BatchNorm,
whose running statistics differ from rank to rank between steps, buffers included and
without a false replica alarm."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpc_ddp.runtime.errors import EXIT_STOPPED
from hpc_ddp.view.runs import load_run
from tests.helpers import REPO, read_summary, run_local_program, run_python
from tests.records import final_weights

PROGRAM = str(REPO / "tests" / "programs" / "regression.py")
#: 2 epochs of 50 optimizer steps; the stop comes mid-way through the second.
ARGUMENTS = ["--epochs", "2", "--samples", "4800", "--batch", "96", "tracking.enabled=false"]
STOP_AT = 70
MODELS = {
    "run.wrap": [],
    "own-ddp": ["--own-ddp"],
    # Built on the meta device: run.wrap shards it, then gives each rank its shards (3 ranks:
    # uneven ones, and none of the last layer's 2 rows on the third rank).
    "fsdp2-meta": ["dist.strategy=fsdp", "checkpoint.save_mode=sync", "--meta"],
}
BATCHNORM = ["--batchnorm"]
#: (model, extra arguments, ranks, the step stopped after): each kind of model at 3 or 4
#: ranks; BatchNorm's running statistics (which differ from rank to rank between steps) at
#: 4, stopped mid-epoch and at an epoch's last step (the evaluation on the unwrapped model
#: that follows uses each rank's own); tests/test_imagenet_shape.py has run.wrap's BatchNorm
#: at 3 ranks mid-epoch. A script's own DDP gets run.wrap's bucket layout:
#: tests/test_user_script.py sees it. (A model without BatchNorm under run.wrap is the same
#: run less its buffers: FSDP2's case has none.)
CASES = [
    ("run.wrap", BATCHNORM, 4, 50),
    ("own-ddp", BATCHNORM, 4, STOP_AT),
    ("fsdp2-meta", [], 3, STOP_AT),
]


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("model", "extra", "ranks", "stop_at"),
    CASES,
    ids=[
        f"{model}{'-batchnorm' if extra else ''}-{ranks}-at-{stop_at}"
        for model, extra, ranks, stop_at in CASES
    ],
)
def test_a_run_stopped_mid_epoch_resumes_bitwise(
    model: str, extra: list[str], ranks: int, stop_at: int, tmp_path: Path
) -> None:
    program = [PROGRAM, *ARGUMENTS, *MODELS[model], *extra, f"run.output_dir={tmp_path}"]
    # The reference builds its model whole: a meta model's shards must start as its do.
    whole = [argument for argument in program if argument != "--meta"]
    reference = run_local_program(ranks, [*whole, "run.id=reference"])
    assert reference.returncode == 0, reference.stderr[-3000:]

    stopped = run_local_program(
        ranks, [*program, "run.id=resumed", f"preempt.stop_at_step={stop_at}"]
    )
    assert stopped.returncode == EXIT_STOPPED, stopped.stderr[-3000:]
    record = load_run(tmp_path / "regression" / "resumed")
    assert record is not None and (record.state, record.global_step) == ("stopped", stop_at)

    resumed = run_local_program(ranks, [*program, "run.id=resumed"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = read_summary(tmp_path, "regression", "reference")
    actual = read_summary(tmp_path, "regression", "resumed")
    assert (actual["world_size"], actual["resumed_from_step"]) == (ranks, stop_at)
    assert resumed.stderr.count(" resumed from ") == 1, "rank 0 says it, once"
    differences = {
        name: float((tensor - final_weights(tmp_path, "regression", "reference")[name]).abs().max())
        for name, tensor in final_weights(tmp_path, "regression", "resumed").items()
    }
    assert actual["weights_sha256"] == expected["weights_sha256"], (
        f"not bitwise equal: largest difference per tensor {differences}"
    )
    assert all(difference == 0.0 for difference in differences.values())
    if extra == BATCHNORM:
        assert any(name.endswith("running_mean") for name in differences), "buffers compared"
        assert "model replicas differ" not in stopped.stderr + resumed.stderr
    assert actual["val_mse"] == expected["val_mse"]
    assert torch.isfinite(torch.tensor(actual["val_mse"]))


@pytest.mark.e2e
def test_a_stop_under_torchrun_is_reported_as_a_stop_with_the_way_to_continue(
    tmp_path: Path,
) -> None:
    """torchrun calls any non-zero exit a failure; its summary's root cause then says what the
    ranks left in its error file: the stop and the command that continues, not a link."""
    program = [PROGRAM, *ARGUMENTS, f"run.output_dir={tmp_path}", "run.id=under-torchrun"]
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    stopped = run_python([*torchrun, *program, f"preempt.stop_at_step={STOP_AT}"], timeout=240)
    assert stopped.returncode != 0, "torchrun's own exit code for a worker that exited 3"
    text = stopped.stderr
    assert "exitcode  : 3" in text, text[-3000:]
    assert (
        f"traceback : stopped at step {STOP_AT} after a checkpoint; to continue, run the same "
        "command with run.id=under-torchrun (exit code 3: a stop, not a failure)"
    ) in text, text[-3000:]
    assert "To enable traceback see" not in text
    finished = run_python([*torchrun, *program], timeout=240)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert read_summary(tmp_path, "regression", "under-torchrun")["resumed_from_step"] == STOP_AT
