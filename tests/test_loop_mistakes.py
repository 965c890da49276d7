"""Two mistakes a script converted from a single-process one makes without an error: a
DataLoader that does not split the data by rank, and a `break` out of run.steps(). Each is
said once, on rank 0, with what to do instead; the right way says nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    SequentialSampler,
    TensorDataset,
)

from hpc_ddp.runtime.loop.streams import unsharded_sampler
from hpc_ddp.runtime.session.misuse import left_by_break
from tests.helpers import run_local_program

DATA = TensorDataset(torch.arange(64.0).reshape(32, 2))


class OwnBatches(BatchSampler):
    """A batch sampler of the user's own, which may take this rank's share itself."""


class Endless(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Iterator[torch.Tensor]:
        yield torch.zeros(2)


@pytest.mark.parametrize(
    ("loader", "world_size", "said"),
    [
        (DataLoader(DATA, batch_size=4, shuffle=True), 2, "RandomSampler reads all 32 samples"),
        (DataLoader(DATA, batch_size=4), 4, "SequentialSampler reads all 32 samples"),
        (DataLoader(DATA, batch_size=4, shuffle=True), 1, None),
        (DataLoader(DATA, batch_size=4, sampler=DistributedSampler(DATA, 2, 0)), 2, None),
        (DataLoader(Endless(), batch_size=4), 2, None),
        (DataLoader(DATA, batch_size=None, shuffle=True), 2, "RandomSampler reads all 32"),
        (DataLoader(DATA, batch_sampler=OwnBatches(SequentialSampler(DATA), 4, False)), 2, None),
        ([torch.zeros(4, 2)], 2, None),
    ],
    ids=[
        "shuffled",
        "in-order",
        "one-rank",
        "distributed-sampler",
        "iterable-dataset",
        "one-by-one",
        "own-batch-sampler",
        "list",
    ],
)
def test_a_dataloader_that_gives_every_rank_all_the_data_is_named(
    loader: object, world_size: int, said: str | None
) -> None:
    found = unsharded_sampler(loader, world_size)
    if said is None:
        assert found is None
    else:
        assert found is not None and said in found and f"each of the {world_size} ranks" in found
        assert "HINT: run.train_loader(dataset, batch_size=GLOBAL_BATCH) shards it" in found


def test_a_break_names_the_step_it_left_uncounted() -> None:
    said = left_by_break(epoch=1, step=7)
    assert "left by a break (or an exception the script caught) in epoch 1, during step 7" in said
    assert "global_step stays 6" in said and "HINT: end early with max_steps=" in said


CONVERTED = """
import sys
import torch
import hpc_ddp
from torch.utils.data import DataLoader, TensorDataset

right = sys.argv[1] in ("right", "without-finish")
run = hpc_ddp.start(tracking={"enabled": False}, checkpoint={"enabled": False})
model = run.wrap(torch.nn.Linear(2, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = TensorDataset(torch.arange(128.0).reshape(64, 2))
if right:
    loader = run.train_loader(data, batch_size=8)
    print(f"rank {run.rank}: dataset of {len(loader.dataset)}, micro-batch {loader.batch_size}")
else:
    loader = DataLoader(data, batch_size=4, shuffle=True)
for epoch in run.epochs(2):
    for index, (batch,) in enumerate(run.steps(loader, max_steps=3 if right else None)):
        loss = model(batch).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if not right and index == 2:  # a dry run's `break`, after the step
            break
print(f"rank {run.rank}: global_step {run.global_step}")
if sys.argv[1] != "without-finish":
    run.finish()
"""


@pytest.mark.e2e
@pytest.mark.parametrize("way", ["converted-plainly", "right", "without-finish"])
def test_a_plain_dataloader_and_a_break_are_each_said_once(way: str, tmp_path: Path) -> None:
    script = tmp_path / "converted.py"
    script.write_text(CONVERTED)
    result = run_local_program(2, ["--set", f"run.output_dir={tmp_path}", str(script), way])
    assert result.returncode == 0, result.stderr[-3000:]
    sampler = [line for line in result.stderr.splitlines() if "reads all 64 samples" in line]
    left = [line for line in result.stderr.splitlines() if "left by a break" in line]
    unfinished = [line for line in result.stderr.splitlines() if "without run.finish()" in line]
    if way == "without-finish":  # every rank ends the same way: said once
        assert len(unfinished) == 1 and "[rank 0/2]" in unfinished[0], result.stderr[-3000:]
        return
    assert unfinished == []
    if way == "right":
        assert (sampler, left) == ([], [])
        assert "rank 0: dataset of 64, micro-batch 4" in result.stdout
        assert "rank 1: global_step 3" in result.stdout
        return
    assert len(sampler) == 1 and "[rank 0/2]" in sampler[0], result.stderr[-3000:]
    assert "RandomSampler reads all 64 samples of its dataset on each of the 2 ranks" in sampler[0]
    # Epoch 0 left during step 3 (2 counted), epoch 1 during step 5: said once, the first.
    assert len(left) == 1 and "[rank 0/2]" in left[0], result.stderr[-3000:]
    assert "caught) in epoch 0, during step 3" in left[0]
    assert "rank 0: global_step 4" in result.stdout
