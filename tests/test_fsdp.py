"""Sharded data parallel (dist.strategy=fsdp, FSDP2's fully_shard) on real gloo ranks, with a
user's own script (tests/programs/regression.py: accumulation, clipping, a scheduler):
it trains as DDP does, stops and resumes bitwise, moves between world sizes and between
DDP and FSDP2 through folder checkpoints."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
import torch

from hpc_ddp.runtime.checkpoint.files import list_checkpoints
from hpc_ddp.runtime.checkpoint.sharded.metadata import read_metadata
from hpc_ddp.runtime.errors import EXIT_STOPPED
from tests.helpers import (
    REPO,
    read_summary,
    run_local_program,
    run_python,
    signal_after,
    start_program,
)
from tests.records import final_weights

pytestmark = pytest.mark.e2e  # every test here starts processes

PROGRAM = str(REPO / "tests" / "programs" / "regression.py")
FSDP = ["dist.strategy=fsdp", "dist.shard_blocks=[0,2]"]
#: 96 samples a step divide over 2, 3 and 4 ranks; 20 steps an epoch.
COMMON = ["--epochs", "2", "--samples", "1920", "--accum", "2", "--clip", "0.5",
          "--log-interval", "1", "preempt.check_every_steps=1",
          "tracking.enabled=false"]  # fmt: skip
#: Steps the ranks hold after until the stop signal reached them (the stop comes one later).
IN_EPOCH_0, IN_EPOCH_1 = 8, 28


def program(output: Path, run_id: str, *extra: str) -> list[str]:
    return [PROGRAM, *COMMON, f"run.output_dir={output}", f"run.id={run_id}", *extra]


def trained(nproc: int, output: Path, run_id: str, *extra: str) -> None:
    result = run_local_program(nproc, program(output, run_id, *extra))
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output folder of the uninterrupted 2-rank DDP run (run id "reference"): trained
    once, the tests that compare with it share it."""
    output = tmp_path_factory.mktemp("ddp")
    trained(2, output, "reference")
    return output


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output folder of the uninterrupted 2-rank FSDP2 run (run id "reference")."""
    output = tmp_path_factory.mktemp("fsdp")
    trained(2, output, "reference", *FSDP)
    return output


def stopped(nproc: int, output: Path, run_id: str, *extra: str, hold: int = IN_EPOCH_1) -> int:
    """Started, held after step ``hold`` (mid-epoch) until SIGUSR1 reached every rank, so
    stopped one step later; the step of the stop's checkpoint."""
    process = start_program(nproc, program(output, run_id, "--hold-at-step", str(hold), *extra))
    log = signal_after(process, rf"HOLDING at step {hold} \(rank 0\)", signal.SIGUSR1)
    assert process.returncode == EXIT_STOPPED, log[-3000:]
    step = int(re.search(r"checkpoint \(stop signal\) step (\d+)", log).group(1))  # type: ignore[union-attr]
    assert step == hold + 1, f"stopped at step {step}"
    return step


def assert_close_weights(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def test_fsdp_trains_as_ddp_does_at_2_and_3_ranks(
    tmp_path: Path, ddp_reference: Path, fsdp_reference: Path
) -> None:
    """Same global batch, same updates: the sharded runs end where DDP ends, to rounding
    (reduce-scatter sums in another order than all-reduce)."""
    trained(3, tmp_path, "fsdp3", *FSDP)
    expected = final_weights(ddp_reference, "regression", "reference")
    expected_mse = float(read_summary(ddp_reference, "regression", "reference")["val_mse"])
    fsdp_runs = ((fsdp_reference, "reference"), (tmp_path, "fsdp3"))
    for output, run_id in fsdp_runs:
        assert_close_weights(final_weights(output, "regression", run_id), expected)
        val_mse = float(read_summary(output, "regression", run_id)["val_mse"])
        assert abs(val_mse - expected_mse) < 1e-5, run_id
    fsdp2 = read_summary(fsdp_reference, "regression", "reference")
    assert fsdp2["global_step"] == 40
    newest = list_checkpoints(tmp_path / "regression" / "fsdp3" / "checkpoints")[0]
    shards = read_metadata(newest).state_dict_metadata["objects.model.0.weight"]
    assert len(shards.chunks) == 3, "each of 3 ranks wrote its own shard"  # type: ignore[union-attr]
    assert fsdp2["weights_sha256"] is not None, "whole weights, on rank 0"


def test_a_model_built_on_the_meta_device_starts_as_the_one_built_whole_and_resumes_bitwise(
    tmp_path: Path, fsdp_reference: Path
) -> None:
    """FSDP2's idiom for a model larger than a host: built on the meta device, run.wrap
    shards it, gives each rank storage for its shards and sets them module by module from a
    whole copy of that module's reset_parameters(): it trains bitwise as the model built whole
    does, and stopped mid-epoch by SIGUSR1 and resumed, ends bitwise there too. (DTensor's
    own random ops would draw the same numbers for every CPU rank's shard: other weights.
    tests/test_exact_at_scale.py: at 3 ranks, uneven shards.)"""
    stop_step = stopped(2, tmp_path, "interrupted", *FSDP, "--meta")
    trained(2, tmp_path, "interrupted", *FSDP, "--meta")
    expected, actual = (
        read_summary(fsdp_reference, "regression", "reference"),
        read_summary(tmp_path, "regression", "interrupted"),
    )
    assert actual["resumed_from_step"] == stop_step
    assert actual["weights_sha256"] == expected["weights_sha256"], "bitwise equal"
    assert actual["val_mse"] == expected["val_mse"]
    newest = list_checkpoints(fsdp_reference / "regression" / "reference" / "checkpoints")[0]
    shards = read_metadata(newest).state_dict_metadata["objects.model.0.weight"]
    assert len(shards.chunks) == 2, "each rank wrote its own shard"  # type: ignore[union-attr]
    assert not list(newest.parent.glob(".writing-*")), "each save's mark goes at its commit"


def test_a_meta_model_with_the_script_s_init_weights_has_a_different_shard_on_each_rank(
    tmp_path: Path,
) -> None:
    """run.wrap(model, init_weights=fn) of a meta model: fn's random draws are taken on the
    whole model on CPU ranks (DTensor's random ops would give every rank the same shard), so
    the weights are the same at 1 and 2 ranks and the two ranks' halves differ. At lr 0 the
    checkpoint holds the initial weights."""
    frozen = ["--meta", "--init-weights", "--lr", "0", "--epochs", "1", *FSDP]
    trained(1, tmp_path, "one", *frozen)
    trained(2, tmp_path, "two", *frozen)
    one, two = (final_weights(tmp_path, "regression", run_id) for run_id in ("one", "two"))
    assert one.keys() == two.keys()
    for name in one:
        assert torch.equal(one[name], two[name]), f"{name} differs between 1 and 2 ranks"
    first = two["0.weight"]
    assert not torch.equal(first[:16], first[16:]), "rank 1's shard is a copy of rank 0's"
    assert 0.3 < float(first.std()) < 0.7, "the script's own init (std 0.5), not Linear's"


def test_a_script_that_shards_its_model_itself_stops_and_resumes_as_run_wrap_s_does(
    tmp_path: Path, fsdp_reference: Path
) -> None:
    """The script calls fully_shard on its layers and its model itself and registers the
    model without run.wrap: no replica check of its shards at the end, accumulation without
    the reduce-scatter and clipping over the whole gradient, as for the model run.wrap
    shards, so it trains bitwise as run.wrap's sharded run; stopped mid-epoch and resumed,
    bitwise again."""
    stop_step = stopped(2, tmp_path, "by_hand", "--shard-by-hand")
    trained(2, tmp_path, "by_hand", "--shard-by-hand")
    expected, actual = (
        read_summary(fsdp_reference, "regression", "reference"),
        read_summary(tmp_path, "regression", "by_hand"),
    )
    assert actual["resumed_from_step"] == stop_step
    assert actual["global_step"] == 40
    assert actual["weights_sha256"] == expected["weights_sha256"], "bitwise equal"
    assert actual["val_mse"] == expected["val_mse"]
    newest = list_checkpoints(tmp_path / "regression" / "by_hand" / "checkpoints")[0]
    shards = read_metadata(newest).state_dict_metadata["objects.model.0.weight"]
    assert len(shards.chunks) == 2, "each rank wrote its own shard"  # type: ignore[union-attr]


@pytest.mark.slow
def test_an_fsdp_checkpoint_of_4_ranks_goes_on_at_2_and_at_3(tmp_path: Path) -> None:
    """Model and optimizer reshard on load; the sample order goes on from the global
    position; the weights end as an uninterrupted run's at the new size, to rounding."""
    trained(2, tmp_path, "reference", *FSDP)
    for nproc in (2, 3):
        run_id = f"from4to{nproc}"
        stop_step = stopped(4, tmp_path, run_id, *FSDP)
        trained(nproc, tmp_path, run_id, *FSDP)
        moved = read_summary(tmp_path, "regression", run_id)
        assert (moved["resumed_from_step"], moved["resumed_from_world_size"]) == (stop_step, 4)
        assert_close_weights(
            final_weights(tmp_path, "regression", run_id),
            final_weights(tmp_path, "regression", "reference"),
        )


def test_a_ddp_checkpoint_goes_on_under_fsdp_and_back(tmp_path: Path, ddp_reference: Path) -> None:
    stopped(2, tmp_path, "mixed", hold=IN_EPOCH_0)
    first = stopped(2, tmp_path, "mixed", *FSDP)  # resumed from DDP's, stopped again
    trained(2, tmp_path, "mixed")  # and on under DDP from FSDP2's
    assert read_summary(tmp_path, "regression", "mixed")["resumed_from_step"] == first
    assert_close_weights(
        final_weights(tmp_path, "regression", "mixed"),
        final_weights(ddp_reference, "regression", "reference"),
    )


def test_a_ddp_single_file_checkpoint_goes_on_under_fsdp(
    tmp_path: Path, ddp_reference: Path
) -> None:
    """A DDP run's single-file checkpoint holds whole states, the optimizer's numbered by
    parameter: under FSDP2 each rank takes its part of every tensor (it was refused with
    "got mixed torch.Tensor and DTensor"), and the weights end as an uninterrupted run's."""
    stop_step = stopped(2, tmp_path, "mixed", "checkpoint.save_mode=single_file", hold=IN_EPOCH_0)
    trained(2, tmp_path, "mixed", *FSDP)
    assert read_summary(tmp_path, "regression", "mixed")["resumed_from_step"] == stop_step
    assert_close_weights(
        final_weights(tmp_path, "regression", "mixed"),
        final_weights(ddp_reference, "regression", "reference"),
    )


def test_blocks_not_in_the_model_and_single_file_saves_are_refused(tmp_path: Path) -> None:
    result = run_local_program(2, program(tmp_path, "bad", "dist.strategy=fsdp",
                                          "dist.shard_blocks=[Block]"))  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert (
        "dist.shard_blocks names 'Block', which is neither a submodule nor a class" in result.stderr
    )
    assert (
        "classes: Linear, Sequential, Tanh" in result.stderr
        and "HINT: name blocks" in result.stderr
    )
    assert "Traceback" not in result.stderr

    single = run_local_program(2, program(tmp_path, "single", *FSDP,
                                          "checkpoint.save_mode=single_file"))  # fmt: skip
    assert single.returncode == 2, single.stderr[-3000:]
    assert "one rank cannot write a sharded model's state alone" in single.stderr
    assert "HINT: use checkpoint.save_mode=async" in single.stderr


def test_the_trainer_and_the_lm_example_shard_with_one_switch(tmp_path: Path) -> None:
    """The built-in trainer (dist.strategy=fsdp in its config's overrides) at 3 ranks and the
    language-model example (--fsdp: its blocks sharded, a tied head) end where their DDP
    runs end; every rank joins each forward pass of the evaluation and the sampling."""
    trainer = ["--config", "digits", "train.epochs=1", "data.batch_size=48",
               "tracking.enabled=false"]  # fmt: skip
    for strategy in ("ddp", "fsdp"):
        result = run_local_program(3, [*trainer, f"run.output_dir={tmp_path / strategy}",
                                       f"dist.strategy={strategy}"])  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
    (ddp,) = (tmp_path / "ddp").glob("*/*/model.pt")
    (fsdp,) = (tmp_path / "fsdp").glob("*/*/model.pt")
    assert_close_weights(torch.load(fsdp, weights_only=True), torch.load(ddp, weights_only=True))

    lm = [str(REPO / "examples" / "lm" / "train.py"), "--train-bytes", "120000", "--val-bytes",
          "20000", "--width", "32", "--layers", "2", "--sample-bytes", "8",
          "tracking.enabled=false"]  # fmt: skip
    results = []
    for flag in ([], ["--fsdp"]):
        result = run_local_program(2, [*lm, *flag, f"run.output_dir={tmp_path / 'lm'}"])
        assert result.returncode == 0, result.stderr[-3000:]
        (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
        results.append(json.loads(line.removeprefix("RESULT ")))
    assert abs(results[0]["val_loss"] - results[1]["val_loss"]) < 1e-5
    assert results[0]["val_tokens"] == results[1]["val_tokens"] == 19999


NESTED = """
import torch, hpc_ddp
from torch import nn
from torch.distributed.fsdp import FSDPModule

class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList(Stage() for _ in range(2))
    def forward(self, x):
        for stage in self.stages:
            x = stage(x)
        return x

run = hpc_ddp.start(tracking={"enabled": False}, dist={"strategy": "fsdp"},
                    run={"output_dir": OUTPUT})
model = run.wrap(Net())
print("SHARDED", sum(isinstance(module, FSDPModule) for module in model.modules()))
first = run.wrap(nn.Linear(4, 4))
optimizer = torch.optim.AdamW([*model.parameters(), *first.parameters()])
run.register(model=model, first=first, optimizer=optimizer)
for _ in run.iterations(2):
    model(first(torch.randn(2, 4))).sum().backward()
    optimizer.step()
run.finish()
"""


def test_nested_blocks_shard_inside_out_and_a_shared_optimizer_is_refused(tmp_path: Path) -> None:
    """Lists inside lists (stages of layers): the inner blocks are sharded before the ones
    holding them (4 layers + 2 stages + the model). An optimizer over two sharded models,
    neither holding all its parameters, is refused at the save: its state could be saved
    only as rank 0's shards."""
    script = NESTED.replace("OUTPUT", repr(str(tmp_path)))
    result = run_python(["-c", script])
    assert "SHARDED 7" in result.stdout, result.stderr[-3000:]
    assert result.returncode == 2, result.stderr[-3000:]
    assert "updates sharded parameters that no one registered module holds" in result.stderr
    assert "HINT: register the model whose parameters it updates" in result.stderr
