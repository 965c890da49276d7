"""A small regression script whose resume is exact, or broken by one mistake named on its
command line: "clean", "scheduler" (a learning-rate scheduler left unregistered),
"scheduler-adam" (the same beside an optimizer with state: AdamW, saved through DCP),
"counter" (a logged count kept outside the run), "loader" (a DataLoader of its own, with its
own shuffling generator, instead of run.train_loader), "optimizer" (an AdamW left
unregistered), "second-model" (a GAN's second network, trained beside the first, wrapped but
not registered, nor its optimizer)."""

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
if mistake in ("scheduler-adam", "optimizer"):
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
else:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
if mistake == "second-model":
    critic = run.wrap(torch.nn.Linear(4, 1))
    critic_optimizer = torch.optim.SGD(critic.parameters(), lr=0.05)
registered: dict[str, Any] = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
if mistake.startswith("scheduler"):
    del registered["scheduler"]
if mistake == "optimizer":
    del registered["optimizer"]
run.register(**registered)
seen = 0
for _epoch in run.epochs(100):
    for inputs, targets in run.steps(loader):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if mistake == "second-model":
            critic_loss = torch.nn.functional.mse_loss(critic(inputs), targets)
            critic_optimizer.zero_grad()
            critic_loss.backward()
            critic_optimizer.step()
        seen += len(inputs)
        run.log("mse", loss.detach() * len(inputs), len(inputs))
        if mistake == "counter":
            run.log("seen", float(seen))
    scheduler.step()
run.finish()
