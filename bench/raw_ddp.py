"""The baseline: a minimal hand-written DDP loop (DistributedSampler, DDP, SGD, nothing else).

Started with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, like any torchrun-style script:
    python -m bench.raw_ddp --hidden 256 256 --samples 65536 --batch 256 --epochs 3
Prints one JSON line from rank 0: samples/s over the training loops, and the wall time of the
first finished step (for the start-up benchmark).
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 256])
    parser.add_argument("--samples", type=int, default=65536)
    parser.add_argument("--batch", type=int, default=256, help="global batch")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: all)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = synthetic_datasets(args.samples, 1, 64, 10, seed=0).train
    assert isinstance(data, TensorDataset)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    width = 64
    for hidden in args.hidden:
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    model = DistributedDataParallel(nn.Sequential(*layers, nn.Linear(width, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler: DistributedSampler[Any] = DistributedSampler(
        data, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True
    )
    loader = DataLoader(data, batch_size=args.batch // world, sampler=sampler, drop_last=True)
    steps, first_step_unix, train_time = 0, 0.0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        started = time.perf_counter()
        for features, labels in loader:
            loss = nn.functional.cross_entropy(model(features), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            steps += 1
            if steps == 1:
                first_step_unix = time.time()
            if args.steps and steps >= args.steps:
                break
        train_time += time.perf_counter() - started
        if args.steps and steps >= args.steps:
            break
    if rank == 0:
        print(
            json.dumps(
                {
                    "samples_per_s": steps * args.batch / train_time,
                    "steps": steps,
                    "first_step_unix": first_step_unix,
                    "pid": os.getpid(),
                }
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
