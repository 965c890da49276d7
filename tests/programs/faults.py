"""A user's script that goes wrong in the ways the toolkit must answer clearly.

python faults.py raise      rank 1 raises in the user's own code at its 3rd step
python faults.py stateless  registers an object without state_dict()
python faults.py extra      registers one object more than regression.py-like runs did
python faults.py bad-config passes a setting hpc_ddp does not know
python faults.py sleep      rank 1 sleeps forever in the user's own code at its 3rd step
python faults.py stuck-worker  rank 1's DataLoader worker hangs on a sample at its 3rd step
python faults.py put       every rank calls Tensor.put_ (no deterministic kernel) at its 3rd step
python faults.py none       trains without a fault
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

import hpc_ddp


def check_the_batch(step: int, rank: int) -> None:
    if rank == 1 and step == 3:
        raise ValueError("the user's own check failed on rank 1")


def wait_for_a_lock_that_never_comes(step: int, rank: int) -> None:
    if rank == 1 and step == 3:
        time.sleep(3600)


def scatter_the_counts(step: int) -> None:
    if step == 3:
        torch.zeros(4).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))


class HangingDataset(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random regression samples; on rank 1, loading the 3rd step's first sample hangs."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.features, self.targets = torch.randn(256, 4), torch.randn(256, 1)

    def __len__(self) -> int:
        return 256

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rank == 1 and index == self.hanging_index:
            time.sleep(3600)
        return self.features[index], self.targets[index]

    hanging_index = -1


def main() -> None:
    fault = sys.argv[1]
    overrides = sys.argv[2:] + (["checkpoint.every_stepz=1"] if fault == "bad-config" else [])
    run = hpc_ddp.start(overrides=overrides, name="faults")
    model = run.wrap(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
    loader = run.train_loader(data, 32)
    if fault == "stuck-worker":
        hanging = HangingDataset(run.rank)
        loader = run.train_loader(hanging, 32, num_workers=1, shuffle=False)
        # rank 1's 16-sample micro-batches are indices 1, 3, 5, ...: the 3rd step's first
        hanging.hanging_index = 2 * 16 * 2 + 1
    objects: dict[str, object] = {"model": model, "optimizer": optimizer}
    if fault == "stateless":
        objects["settings"] = {"lr": 0.1}
    if fault == "extra":
        objects["ema"] = nn.Linear(4, 1)
    run.register(**objects)
    for _epoch in run.epochs(2):
        for features, target in run.steps(loader):
            if fault == "raise":
                check_the_batch(run.global_step, run.rank)
            if fault == "put":
                scatter_the_counts(run.global_step)
            if fault == "sleep":
                wait_for_a_lock_that_never_comes(run.global_step, run.rank)
            loss = nn.functional.mse_loss(model(features), target)
            loss.backward()
            if fault == "rank-metric" and run.is_main:
                run.log("rank_zero_only", loss.detach())
            optimizer.step()
            optimizer.zero_grad()
    run.finish()


if __name__ == "__main__":
    main()
