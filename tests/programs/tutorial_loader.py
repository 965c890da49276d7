"""PyTorch's DDP tutorial as docs/converting.md converts it: the script's own DDP, its own
DataLoader with a DistributedSampler, a dropout layer (its masks come from torch's random
stream, which a resume must leave where the run never stopped left it) and its own
validation loader, iterated each epoch.

    hpc-ddp local --nproc 2 tests/programs/tutorial_loader.py --epochs 3
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hpc_ddp


def load_train_objs() -> tuple[TensorDataset, TensorDataset, nn.Module]:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(1280, 12, generator=generator)
    targets = inputs @ torch.randn(12, 1, generator=generator)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    return (
        TensorDataset(inputs[:1024], targets[:1024]),
        TensorDataset(inputs[1024:], targets[1024:]),
        model,
    )


def main(epochs: int, batch_size: int) -> None:
    run = hpc_ddp.start()
    dataset, validation, model = load_train_objs()
    model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    run.register(model=model, optimizer=optimizer)
    sampler: DistributedSampler[int] = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    val_loader = DataLoader(validation, batch_size=64, sampler=DistributedSampler(validation))
    for epoch in run.epochs(epochs):
        sampler.set_epoch(epoch)
        model.train()
        for source, targets in run.steps(loader):
            optimizer.zero_grad()
            loss = F.mse_loss(model(source), targets)
            loss.backward()
            optimizer.step()
            run.log("loss", loss.detach() * len(targets), len(targets))
        model.eval()
        total = torch.zeros(2)
        with torch.no_grad():
            for source, targets in val_loader:
                total[0] += F.mse_loss(model(source), targets, reduction="sum")
                total[1] += len(targets)
        dist.all_reduce(total)
        run.log_metrics({"val_loss": (total[0] / total[1]).item()})
    run.finish()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank, as the tutorial's")
    args = parser.parse_args()
    main(args.epochs, args.batch_size)
