"""Trains until the file given on the command line appears (every rank stops at the same
step: they agree on it through an all-reduce), printing ``TRAINING (rank r, pid p)`` once
its steps run, so that a test can suspend the job while it trains (SIGSTOP, as ``scontrol
suspend`` does) for longer than dist.stall_timeout_s and resume it."""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import hpc_ddp

release = Path(sys.argv[1])
run = hpc_ddp.start(
    tracking={"enabled": False}, checkpoint={"enabled": False}, dist={"stall_timeout_s": 10}
)
model = run.wrap(torch.nn.Linear(2, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
run.register(model=model, optimizer=optimizer)
for step in run.iterations():
    model(torch.ones(2, 2)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    if step == 5:
        print(f"TRAINING (rank {run.rank}, pid {os.getpid()})", file=sys.stderr, flush=True)
    released = torch.tensor(float(release.exists()))
    dist.all_reduce(released, op=dist.ReduceOp.MAX)
    if released.item():
        print(f"RELEASED at step {step} (rank {run.rank})", file=sys.stderr, flush=True)
        break
run.finish()
