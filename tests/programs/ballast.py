"""A small regression model beside a large registered state (``--ballast-mb`` of a buffer
that training never changes), so that writing a checkpoint takes long enough to be caught
in the middle. Each rank prints ``STEP <n> <pid>`` after every optimizer step.

    hpc-ddp local --nproc 2 tests/programs/ballast.py --steps 40 --ballast-mb 256

``--hold-commit-at N``: the save of step N writes every rank's part, then holds before its
``.metadata`` commits it (``HOLDING the commit of step N`` on stdout), until the process is
killed: a node lost in the middle of a save, at a moment known whatever the machine's pace.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import hpc_ddp


class Ballast(nn.Module):
    """``megabytes`` of float32 in 16 tensors, as a model's state is spread over layers."""

    def __init__(self, megabytes: int) -> None:
        super().__init__()
        for index in range(16):
            self.register_buffer(f"part{index}", torch.full((megabytes * 2**14,), float(index)))


def hold_the_commit(step: int) -> None:
    """The save of ``step`` holds before torch's writer commits it (see the docstring)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    commit = FileSystemWriter.finish

    def holding(writer: Any, metadata: Any, results: Any) -> None:
        if Path(str(writer.path)).name == f"step-{step:09d}":
            print(f"HOLDING the commit of step {step}", flush=True)
            time.sleep(600)  # until the kill the caller sends on the line above
            sys.exit(f"the commit of step {step} was held for 600 s and no kill came")
        commit(writer, metadata, results)

    FileSystemWriter.finish = holding  # type: ignore[method-assign,assignment]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ballast-mb", type=int, default=256)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--step-pause", type=float, default=0.0, help="seconds: a slower step")
    parser.add_argument("--hold-commit-at", type=int, default=None, help="a step (see above)")
    args, settings = parser.parse_known_args()
    if args.hold_commit_at is not None:
        hold_the_commit(args.hold_commit_at)
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
