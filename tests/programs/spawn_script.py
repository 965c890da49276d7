"""A script in the classic ``torch.multiprocessing.spawn`` shape, written only against
hpc_ddp's public API: ``main(rank, world_size, ...)`` started once per rank, a
DistributedSampler and a DataLoader of its own, a per-rank batch, MLflow on rank 0 (through
the run). ``hpc_ddp.spawn`` stands where ``mp.spawn`` stood, so it runs under plain python
(N local ranks) and under every launcher:

    python tests/programs/spawn_script.py --world-size 2
    sbatch slurm/train.sh tests/programs/spawn_script.py
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hpc_ddp
from tests.programs.holding import StopSignalSeen


def make_dataset(size: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(size, 20, generator=generator)
    y = (x[:, :10].sum(dim=1, keepdim=True) - x[:, 10:].sum(dim=1, keepdim=True)).tanh()
    return TensorDataset(x, y)


def main(rank: int, world_size: int, args: argparse.Namespace, overrides: list[str]) -> None:
    run = hpc_ddp.start(overrides=overrides, params=vars(args), log_interval=5)
    assert run.rank == rank, (run.rank, rank)
    signals = StopSignalSeen() if args.hold_at_step is not None else None
    dataset = make_dataset(args.samples)
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        dataset, seed=args.seed
    )
    loader = DataLoader(dataset, batch_size=args.batch // run.world_size, sampler=sampler)
    model = run.wrap(nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    run.register(model=model, optimizer=optimizer)

    for epoch in run.epochs(args.epochs):
        sampler.set_epoch(epoch)
        for source, targets in run.steps(loader):
            source, targets = source.to(run.device), targets.to(run.device)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(source), targets)
            loss.backward()
            optimizer.step()
            run.log("loss", loss.detach() * len(source), len(source))
            time.sleep(args.step_pause)
            if signals and run.global_step + 1 == args.hold_at_step:
                signals.hold(run.rank, args.hold_at_step)

    summary = run.finish()
    if run.is_main:
        keys = ("global_step", "weights_sha256", "samples_seen")
        print("RESULT " + json.dumps({key: summary[key] for key in keys}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-pause", type=float, default=0.0)
    parser.add_argument("--hold-at-step", type=int, default=None, help="tests/programs/holding.py")
    arguments, rest = parser.parse_known_args()
    hpc_ddp.spawn(main, args=(arguments.world_size, arguments, rest), nprocs=arguments.world_size)
