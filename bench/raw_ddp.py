"""The baseline: a minimal hand-written DDP loop (DistributedSampler, DDP, SGD, nothing else).

Started with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, like any torchrun-style script:
    python -m bench.raw_ddp --hidden 256 256 --samples 65536 --batch 256 --epochs 3
Prints one JSON line from rank 0: samples/s over the training loops, and the wall time of the
first finished step (for the start-up benchmark). :class:`RawLoop` is the same loop for
`bench.interleaved`, which runs it in turn with hpc_ddp's inside one pair of ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from hpc_ddp.data import synthetic_datasets


class RawLoop:
    """Model, optimizer, sampler and loader of the hand-written loop, on the default group."""

    def __init__(self, hidden_sizes: list[int], samples: int, global_batch: int) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        data = synthetic_datasets(samples, 1, 64, 10, seed=0).train
        assert isinstance(data, TensorDataset)
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        width = 64
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        self.model = DistributedDataParallel(nn.Sequential(*layers, nn.Linear(width, 10)))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.sampler: DistributedSampler[Any] = DistributedSampler(
            data, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True
        )
        self.loader = DataLoader(
            data, batch_size=global_batch // world, sampler=self.sampler, drop_last=True
        )
        self.steps = 0
        self.first_step_unix = 0.0

    def step(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        loss = nn.functional.cross_entropy(self.model(features), labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.steps += 1
        if self.steps == 1:
            self.first_step_unix = time.time()

    def epoch(self, epoch: int, max_steps: int = 0) -> float:
        """Train one epoch (or until ``max_steps`` in all); returns its seconds."""
        self.sampler.set_epoch(epoch)
        started = time.perf_counter()
        for features, labels in self.loader:
            self.step(features, labels)
            if max_steps and self.steps >= max_steps:
                break
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 256])
    parser.add_argument("--samples", type=int, default=65536)
    parser.add_argument("--batch", type=int, default=256, help="global batch")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: all)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    loop = RawLoop(args.hidden, args.samples, args.batch)
    train_time = 0.0
    for epoch in range(args.epochs):
        train_time += loop.epoch(epoch, args.steps)
        if args.steps and loop.steps >= args.steps:
            break
    if dist.get_rank() == 0:
        print(
            json.dumps(
                {
                    "samples_per_s": loop.steps * args.batch / train_time,
                    "steps": loop.steps,
                    "first_step_unix": loop.first_step_unix,
                    "pid": os.getpid(),
                }
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
