"""pytorch/examples' imagenet/main.py, converted as docs/converting.md shows
(tests/programs/imagenet_shape.py): a ResNet with BatchNorm2d, SGD with momentum and a
registered StepLR, the best accuracy kept in ``run.state``. Stopped mid-epoch and rerun, it
ends bitwise where the uninterrupted run does, buffers, learning rate and best accuracy
included, at 2 ranks and at 3 (where the order of a gradient's sum over the ranks matters);
``--evaluate`` then gives both runs the same accuracy. Real local gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.runtime.errors import EXIT_STOPPED
from tests.helpers import REPO, read_summary, run_local_program
from tests.records import final_weights

pytestmark = pytest.mark.e2e

PROGRAM = str(REPO / "tests" / "programs" / "imagenet_shape.py")


def printed(output: str, tag: str) -> dict[str, Any]:
    lines = [line for line in output.splitlines() if line.startswith(f"{tag} ")]
    assert len(lines) == 1, output[-2000:]
    return json.loads(lines[0].removeprefix(f"{tag} "))  # type: ignore[no-any-return]


#: (ranks, global batch, the step stopped after): 320 images, 2 epochs; each stop lands in
#: the second epoch, after the StepLR's first decay. 3 ranks pins what 2 do and more (a sum
#: over ranks whose order matters), so 2 run with --slow only.
CASES = [
    pytest.param(2, 16, 30, id="2-ranks", marks=pytest.mark.slow),
    pytest.param(3, 24, 19, id="3-ranks"),
]


@pytest.mark.parametrize(("ranks", "batch", "stop_at"), CASES)
def test_the_converted_imagenet_script_resumes_bitwise(
    ranks: int, batch: int, stop_at: int, tmp_path: Path
) -> None:
    program = [PROGRAM, "--epochs", "2", "--batch-size", str(batch), "tracking.enabled=false",
               f"run.output_dir={tmp_path}"]  # fmt: skip
    reference = run_local_program(ranks, [*program, "run.id=reference"])
    assert reference.returncode == 0, reference.stderr[-3000:]
    stopped = run_local_program(
        ranks, [*program, "run.id=resumed", f"preempt.stop_at_step={stop_at}"]
    )
    assert stopped.returncode == EXIT_STOPPED, stopped.stderr[-3000:]
    resumed = run_local_program(ranks, [*program, "run.id=resumed"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_summary(tmp_path, "imagenet_shape", "resumed")["resumed_from_step"] == stop_at

    expected, actual = printed(reference.stdout, "RESULT"), printed(resumed.stdout, "RESULT")
    assert actual["world_size"] == ranks and actual["global_step"] == expected["global_step"]
    assert actual["lr"] == expected["lr"] == pytest.approx(0.001), "StepLR decayed twice"
    assert actual["best_acc1"] == expected["best_acc1"]
    weights = final_weights(tmp_path, "imagenet_shape", "resumed")
    reference_weights = final_weights(tmp_path, "imagenet_shape", "reference")
    assert any(name.endswith("running_var") for name in weights), "BatchNorm's buffers compared"
    differing = [name for name in weights if not weights[name].equal(reference_weights[name])]
    assert differing == [] and actual["weights_sha256"] == expected["weights_sha256"], differing

    evaluated = {
        run_id: run_local_program(ranks, [*program, f"run.id={run_id}", "--evaluate"])
        for run_id in ("reference", "resumed")
    }
    for result in evaluated.values():
        assert result.returncode == 0, result.stderr[-3000:]
    accuracy = {run_id: printed(result.stdout, "EVALUATED") for run_id, result in evaluated.items()}
    assert accuracy["reference"] == accuracy["resumed"]
    assert 0.0 <= accuracy["resumed"]["acc1"] <= 100.0
