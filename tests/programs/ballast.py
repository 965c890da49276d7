"""A small regression model beside a large registered state (``--ballast-mb`` of a buffer
that training never changes), so that writing a checkpoint takes long enough to be caught
in the middle. Each rank prints ``STEP <n> <pid>`` after every optimizer step.

    hpc-ddp local --nproc 2 tests/programs/ballast.py --steps 40 --ballast-mb 256
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

import hpc_ddp


class Ballast(nn.Module):
    """``megabytes`` of float32 in 16 tensors, as a model's state is spread over layers."""

    def __init__(self, megabytes: int) -> None:
        super().__init__()
        for index in range(16):
            self.register_buffer(f"part{index}", torch.full((megabytes * 2**14,), float(index)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ballast-mb", type=int, default=256)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--step-pause", type=float, default=0.0, help="seconds: a slower step")
    args, settings = parser.parse_known_args()
    run = hpc_ddp.start(overrides=settings, tracking={"enabled": False})
    model = run.wrap(nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    run.register(model=model, optimizer=optimizer, ballast=Ballast(args.ballast_mb))
    generator = torch.Generator().manual_seed(7)
    inputs, targets = torch.randn(4096, 8, generator=generator), torch.randn(4096, 1)
    batches = [(inputs[i : i + 64], targets[i : i + 64]) for i in range(0, 4096, 64)]
    for _step in run.iterations(args.steps):
        x, y = batches[(run.global_step * run.world_size + run.rank) % len(batches)]
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if run.every(args.save_every):
            run.save()
        print(f"STEP {run.global_step + 1} {os.getpid()}", flush=True)
        time.sleep(args.step_pause)
    run.finish()


if __name__ == "__main__":
    main()
