"""pytorch/examples' mnist/main.py as docs/converting.md converts it: the same Net (sized
for 8x8 images), Adadelta with a StepLR, train() and test() over loaders, ``--dry-run`` and
``--save-model``. scikit-learn's 8x8 digits stand in for torchvision's MNIST, whose wheels
on PyPI are built for CUDA's torch and do not load beside the CPU build these tests run on.

    hpc-ddp local --nproc 2 tests/programs/mnist_shape.py --epochs 2
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from sklearn.datasets import load_digits
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import TensorDataset

import hpc_ddp


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(256, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def train(args, run, model, device, train_loader, optimizer, epoch):
    model.train()
    steps = run.steps(train_loader, max_steps=1 if args.dry_run else None)
    for batch_idx, (data, target) in enumerate(steps):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        run.log("loss", loss.detach() * len(data), len(data))
        if run.is_main and batch_idx % args.log_interval == 0:
            print(
                f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_loader.dataset)} "
                f"({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}"
            )


def test(run, model, device, test_loader):
    model.eval()
    sums = run.sums()
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            sums.add("test_loss", F.nll_loss(output, target, reduction="sum"), len(data))
            pred = output.argmax(dim=1, keepdim=True)
            sums.add("test_accuracy", pred.eq(target.view_as(pred)).sum(), len(data))
    run.log_metrics(sums.reduce())


def digits(train: bool) -> TensorDataset:
    images, labels = load_digits(return_X_y=True)
    images = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    images = (images - 0.3) / 0.4  # transforms.Normalize's part
    split = slice(0, 1500) if train else slice(1500, None)
    return TensorDataset(images[split], torch.tensor(labels)[split])


def main() -> None:
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example (converted)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--test-batch-size", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--save-model", action="store_true")
    args = parser.parse_args()
    run = hpc_ddp.start(params=vars(args))
    torch.manual_seed(args.seed)
    device = run.device

    dataset1 = digits(train=True)
    dataset2 = digits(train=False)
    train_loader = run.train_loader(dataset1, batch_size=args.batch_size)
    test_loader = run.eval_loader(dataset2, batch_size=args.test_batch_size)

    model = run.wrap(Net())
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)

    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    run.register(model=model, optimizer=optimizer, scheduler=scheduler)
    for epoch in run.epochs(args.epochs):
        train(args, run, model, device, train_loader, optimizer, epoch + 1)
        test(run, model, device, test_loader)
        scheduler.step()

    if args.save_model and run.is_main:
        torch.save(run.unwrap(model).state_dict(), "mnist_cnn.pt")
    summary = run.finish()
    if run.is_main:
        keys = ("global_step", "weights_sha256", "world_size")
        result = {key: summary[key] for key in keys}
        result["lr"] = optimizer.param_groups[0]["lr"]
        print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
