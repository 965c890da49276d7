"""The examples on the real test Slurm cluster through slurm/train.sh, as a user submits
them: 2 nodes, one rank each; a USR1 from `scancel --signal=USR1` during training stops every
rank, the job requeues and resumes, and the final weights are bitwise those of an
uninterrupted job. (Two "nodes" are two slurmd on this machine, and their GPUs are stand-in
devices: a second physical host and a GPU cannot exist here, so the ranks train on CPUs.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.examples import CNN, LM, TUTORIAL, Example, settings
from tests.helpers import REPO, read_summary
from tests.slurm_cluster import SlurmCluster, prepare_workdir

pytestmark = pytest.mark.slurm
TRAIN = str(REPO / "slurm" / "train.sh")
#: One rank per node, so that the interrupted job and its reference run side by side.
LAYOUT = ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1"]
#: Long enough that a signal sent on the first progress lines lands before the end.
LONGER = {
    "lm": ["--epochs", "1", "--train-bytes", "300000"],
    "digits_cnn": ["--epochs", "12"],
    "tutorial": ["--snapshot_path", "snapshot.pt"],
}
#: A line that shows training is under way (the tutorial logs its own epochs' ends).
UNDER_WAY = {
    "lm": r"\[rank 0/2\] INFO epoch 0 step (2\d|3\d)/",
    "digits_cnn": r"\[rank 0/2\] INFO epoch [1-3] step",
    "tutorial": r"\[rank 0\] epoch 1 \|",
}


def submit(slurm: SlurmCluster, example: Example, work: Path, *extra: str) -> str:
    args = list(example.command(*LONGER[example.name], *extra))
    if example is TUTORIAL:
        args[1] = "40"  # epochs
    overrides = settings(
        work / "runs", "job", "tracking.enabled=false", "preempt.check_every_steps=1"
    )
    export = f"--export=ALL,HPC_DDP_OVERRIDES={overrides['HPC_DDP_OVERRIDES']}"
    return slurm.sbatch([*LAYOUT, export, TRAIN, *args], work)


# One example in the default suite; the others repeat its requeue path (pytest --slow), the
# language model sharded with FSDP2 (--fsdp) among them.
@pytest.mark.parametrize(
    ("example", "extra"),
    [
        (LM, ()),
        pytest.param(LM, ("--fsdp",), marks=pytest.mark.slow, id="lm-fsdp"),
        pytest.param(CNN, (), marks=pytest.mark.slow),
        pytest.param(TUTORIAL, (), marks=pytest.mark.slow),
    ],
    ids=lambda value: value.name if isinstance(value, Example) else None,
)
def test_an_example_on_two_nodes_requeues_once_and_ends_with_the_uninterrupted_weights(
    slurm: SlurmCluster, tmp_path: Path, example: Example, extra: tuple[str, ...]
) -> None:
    interrupted = prepare_workdir(tmp_path / "interrupted")
    reference = prepare_workdir(tmp_path / "reference")
    job = submit(slurm, example, interrupted, *extra)
    reference_job = submit(slurm, example, reference, *extra)
    log_path = interrupted / f"hpc-ddp-{job}.out"
    _, stop_step = slurm.requeue_by_signal(
        job, interrupted, log_path, UNDER_WAY[example.name], timeout=180
    )
    assert slurm.wait(reference_job, timeout=300) == "COMPLETED"

    facts, expected = (
        read_summary(interrupted / "runs", example.name, "job"),
        read_summary(reference / "runs", example.name, "job"),
    )
    assert (facts["world_size"], facts["num_nodes"], facts["launcher"]) == (2, 2, "slurm")
    assert facts["restart_count"] == 1 and facts["resumed_from_step"] == stop_step
    assert 0 < stop_step < expected["global_step"] == facts["global_step"]
    assert expected["restart_count"] == 0
    assert facts["weights_sha256"] == expected["weights_sha256"], "bitwise equal"
    for key in ("val_loss", "val_accuracy", "confusion"):
        assert facts.get(key) == expected.get(key)
    if example is LM:
        assert stop_step < 585, "stopped inside the epoch"  # 300000 bytes / 32 / 16
