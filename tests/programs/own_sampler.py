"""A user's own DataLoader with their own sampler, written only against hpc_ddp's public
API: a weighted sampler (rare classes drawn more often) that deals each global batch out to
the ranks, so every optimizer step sees the same samples at any world size.

    hpc-ddp local --nproc 2 tests/programs/own_sampler.py --epochs 2
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

import hpc_ddp


class WeightedShardSampler(Sampler[int]):
    """Each epoch draws ``draws`` indices with probability ``weights`` from (seed, epoch),
    cuts them into global batches and gives this rank its slice of each one."""

    def __init__(
        self, weights: torch.Tensor, draws: int, global_batch: int, rank: int, world: int
    ) -> None:
        self.weights, self.draws, self.global_batch = weights, draws, global_batch
        self.rank, self.world = rank, world
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(1234 + self.epoch)
        order = torch.multinomial(self.weights, self.draws, True, generator=generator)
        share = self.global_batch // self.world
        batches = order[: len(self) * self.world].view(-1, self.world, share)
        return iter(batches[:, self.rank].flatten().tolist())

    def __len__(self) -> int:
        return (self.draws // self.global_batch) * (self.global_batch // self.world)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=48, help="global batch")
    parser.add_argument("--draws", type=int, default=2400, help="samples per epoch")
    parser.add_argument("--step-pause", type=float, default=0.0)
    args, overrides = parser.parse_known_args()

    run = hpc_ddp.start(overrides=overrides, params=vars(args), log_interval=5)
    generator = torch.Generator().manual_seed(0)
    labels = (torch.rand(3000, generator=generator) < 0.1).long()  # 10% of class 1
    features = torch.randn(3000, 6, generator=generator) + labels[:, None] * 1.5
    weights = torch.where(labels == 1, 9.0, 1.0)  # draw both classes about equally often
    sampler = WeightedShardSampler(weights, args.draws, args.batch, run.rank, run.world_size)
    loader = DataLoader(
        TensorDataset(features, labels), batch_size=args.batch // run.world_size, sampler=sampler
    )
    model = run.wrap(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    run.register(model=model, optimizer=optimizer)

    for epoch in run.epochs(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in run.steps(loader):
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            run.log("loss", loss.detach() * len(y), len(y))
            run.log("class1", (y == 1).sum(), len(y))
            time.sleep(args.step_pause)

    summary = run.finish()
    if run.is_main:
        keys = ("global_step", "weights_sha256", "samples_seen")
        result = {key: summary[key] for key in keys}
        result["class1_share"] = float(run.train_metrics["class1"].mean)
        print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
