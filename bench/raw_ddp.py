"""The baseline: a minimal hand-written DDP loop (DistributedSampler, DDP, SGD, nothing else).

Started with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, like any torchrun-style script:
    python -m bench.raw_ddp --hidden 256 256 --samples 65536 --batch 256 --epochs 3
    python -m bench.raw_ddp --device cuda --bf16 ...   # NCCL, cuda:LOCAL_RANK, bf16 autocast
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

from hpc_ddp.trainer.datasets import synthetic_datasets


def raw_model(hidden_sizes: list[int]) -> nn.Module:
    """The MLP 64-hidden...-10 both benchmark sides train, initialised from seed 0."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    width = 64
    for hidden in hidden_sizes:
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(*layers, nn.Linear(width, 10))


class RawLoop:
    """Model, optimizer, sampler and loader of the hand-written loop, on the default group."""

    def __init__(
        self,
        hidden_sizes: list[int],
        samples: int,
        global_batch: int,
        device: torch.device | None = None,
        bf16: bool = False,
        num_workers: int = 0,
        shard: bool = False,
    ) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self.device = device or torch.device("cpu")
        self.bf16 = bf16
        data = synthetic_datasets(samples, 1, 64, 10, seed=0).train
        assert isinstance(data, TensorDataset)
        module = raw_model(hidden_sizes).to(self.device)
        on_gpu = self.device.type == "cuda"
        if shard:  # the hand-written FSDP2 loop: fully_shard on each layer, then the model
            from torch.distributed.fsdp import fully_shard

            for layer in module.modules():
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            fully_shard(module)
            self.model: nn.Module = module
        else:
            self.model = DistributedDataParallel(
                module, device_ids=[self.device.index] if on_gpu else None
            )
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.sampler: DistributedSampler[Any] = DistributedSampler(
            data, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True
        )
        self.loader = DataLoader(
            data,
            batch_size=global_batch // world,
            sampler=self.sampler,
            drop_last=True,
            num_workers=num_workers,
            pin_memory=on_gpu,
            persistent_workers=num_workers > 0,
        )
        self.steps = 0
        self.first_step_unix = 0.0

    def step(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        if self.device.type == "cuda":
            features = features.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
        if self.bf16:
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(self.model(features).float(), labels)
        else:
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
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # count the queued kernels in this epoch
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 256])
    parser.add_argument("--samples", type=int, default=65536)
    parser.add_argument("--batch", type=int, default=256, help="global batch")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: all)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast, as train.precision")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers")
    args = parser.parse_args()

    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    loop = RawLoop(args.hidden, args.samples, args.batch, device, args.bf16, args.workers)
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
