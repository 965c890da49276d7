"""Rank given on the command line stops itself with SIGSTOP at step 5 (as a frozen node, or
a debugger, would leave it); the other rank waits for it in the next collective."""

import os
import signal
import sys

import torch

import hpc_ddp

stopped_rank = int(sys.argv[1])
run = hpc_ddp.start(
    tracking={"enabled": False},
    checkpoint={"enabled": False},
    dist={"stall_timeout_s": 15},  # past a busy machine's pauses
)
model = run.wrap(torch.nn.Linear(2, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
run.register(model=model, optimizer=optimizer)
for step in run.iterations(1000):
    if step == 5 and run.rank == stopped_rank:
        os.kill(os.getpid(), signal.SIGSTOP)
    model(torch.ones(2, 2)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
run.finish()
