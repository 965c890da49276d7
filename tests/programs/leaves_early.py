"""Rank 1 leaves the training loop at step 5 the way given on the command line
(sys.exit(0), sys.exit(3), sys.exit(None), os._exit(0)); rank 0 trains on."""

import os
import sys

import torch

import hpc_ddp

run = hpc_ddp.start(tracking={"enabled": False}, preempt={"check_every_steps": 1})
model = run.wrap(torch.nn.Linear(2, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
run.register(model=model, optimizer=optimizer)
how = sys.argv[1]
for step in run.iterations(50):
    if step == 5 and run.rank == 1:
        if how == "os":
            os._exit(0)
        sys.exit(None if how == "none" else int(how))
    model(torch.ones(2, 2)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
run.finish()
