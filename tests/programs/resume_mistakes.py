"""A small regression script whose resume is exact, or broken by one mistake named on its
command line: "clean", "scheduler" (a learning-rate scheduler left unregistered),
"scheduler-adam" (the same beside an optimizer with state: AdamW, saved through DCP),
"counter" (a logged count kept outside the run), "loader" (a DataLoader of its own, with its
own shuffling generator, instead of run.train_loader)."""

import sys
from typing import Any

import torch

import hpc_ddp

mistake = sys.argv[1]
loader: Any
run = hpc_ddp.start(run={"name": "mistakes"})
generator = torch.Generator().manual_seed(0)
features = torch.randn(64, 4, generator=generator)
dataset = torch.utils.data.TensorDataset(features, features.sum(1, keepdim=True))
if mistake == "loader":
    shuffled = torch.Generator().manual_seed(1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True, generator=shuffled)
else:
    loader = run.train_loader(dataset, 8)  # the global batch, at any number of ranks
model = run.wrap(torch.nn.Linear(4, 1))
optimizer: torch.optim.Optimizer
if mistake == "scheduler-adam":
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
else:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
if mistake.startswith("scheduler"):
    run.register(model=model, optimizer=optimizer)
else:
    run.register(model=model, optimizer=optimizer, scheduler=scheduler)
seen = 0
for _epoch in run.epochs(100):
    for inputs, targets in run.steps(loader):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seen += len(inputs)
        run.log("mse", loss.detach() * len(inputs), len(inputs))
        if mistake == "counter":
            run.log("seen", float(seen))
    scheduler.step()
run.finish()
