"""A small convolutional network on scikit-learn's bundled handwritten digits (1x8x8 images).

The data ships inside scikit-learn, so nothing downloads: 1,797 images, 1,497 for training
and 300 held out. Augmentation (a one-pixel shift, a contrast change and noise) happens in
the Dataset, inside DataLoader worker processes. Its randomness is drawn from the sample's
index and the epoch, never from a worker's own stream, so it is the same at any world size
and worker count and a resumed run sees exactly the images an uninterrupted one would.
Evaluation reports top-1 accuracy and a per-class confusion count, both summed exactly
across ranks.

    hpc-ddp local --nproc 2 examples/digits_cnn/train.py
    sbatch slurm/train.sh examples/digits_cnn/train.py --epochs 20
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

import hpc_ddp

CLASSES = 10


def digits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train images, train labels, val images, val labels); images 1x8x8 in [0, 1]."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    x = torch.as_tensor(images, dtype=torch.float32).view(-1, 1, 8, 8)[order] / 16.0
    y = torch.as_tensor(labels, dtype=torch.long)[order]
    return x[300:], y[300:], x[:300], y[:300]


class Digits(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Images and labels; with ``augment``, each image is changed as (seed, epoch, index)
    decide. The epoch lives in shared memory, so worker processes see :meth:`set_epoch`."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, augment: bool, seed: int = 0):
        self.images, self.labels, self.augment, self.seed = images, labels, augment, seed
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        if self.augment:
            seed = (self.seed * 1_000_003 + int(self.epoch)) * 1_000_003 + index
            generator = torch.Generator().manual_seed(seed)
            shift = torch.randint(-1, 2, (2,), generator=generator).tolist()
            image = torch.roll(F.pad(image, (1, 1, 1, 1)), shifts=shift, dims=(1, 2))[:, 1:-1, 1:-1]
            contrast = 0.8 + 0.4 * torch.rand((), generator=generator)
            noise = 0.05 * torch.randn(image.shape, generator=generator)
            image = (image * contrast + noise).clamp(0, 1)
        return image, self.labels[index]


def network() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, CLASSES),
    )


def evaluate(run: hpc_ddp.Run, model: nn.Module, loader: Any) -> dict[str, hpc_ddp.Sum]:
    """Loss, top-1 accuracy and the confusion counts (rows: true class, columns: predicted)
    over every held-out image exactly once."""
    sums = run.sums()
    model.eval()
    with torch.no_grad():
        for images, labels in loader:
            logits = model(images)
            predicted = logits.argmax(dim=1)
            sums.add("loss", F.cross_entropy(logits, labels, reduction="sum").double(), len(labels))
            sums.add("accuracy", (predicted == labels).sum().double(), len(labels))
            pairs = labels * CLASSES + predicted
            confusion = torch.bincount(pairs, minlength=CLASSES * CLASSES).view(CLASSES, CLASSES)
            sums.add("confusion", confusion.double(), len(labels))
    model.train()
    return sums.reduce()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    parser.add_argument("--no-augment", dest="augment", action="store_false")
    parser.add_argument("--log-interval", type=int, default=None, help="steps between logs")
    args, overrides = parser.parse_known_args(argv)  # the rest: hpc_ddp's dotted overrides

    run = hpc_ddp.start(
        overrides=overrides,
        run={"name": "digits_cnn"},
        params=vars(args),
        fingerprint={"batch": args.batch, "lr": args.lr, "augment": args.augment},
        log_interval=args.log_interval,
    )
    model = run.wrap(network())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True)
    train_x, train_y, val_x, val_y = digits()
    train_set = Digits(train_x, train_y, augment=args.augment, seed=run.config.run.seed)
    loader = run.train_loader(train_set, args.batch, num_workers=args.workers)
    val_loader = run.eval_loader(Digits(val_x, val_y, augment=False), batch_size=100)
    total = args.epochs * loader.steps_per_epoch
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=total)
    run.register(model=model, optimizer=optimizer, scheduler=scheduler)

    for epoch in run.epochs(args.epochs):
        train_set.set_epoch(epoch)  # before the epoch's first batch is asked for
        for images, labels in run.steps(loader):
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            run.log("loss", loss.detach() * len(labels), len(labels))
            run.log("accuracy", (logits.argmax(1) == labels).sum(), len(labels))
        val = evaluate(run, model, val_loader)
        run.log_metrics(
            {"val_loss": float(val["loss"].mean), "val_accuracy": float(val["accuracy"].mean)}
        )

    confusion = val["confusion"].total.long()
    if run.is_main:
        run.log_text(
            "confusion.txt",
            "\n".join(" ".join(f"{n:3d}" for n in row) for row in confusion.tolist()),
        )
    summary = run.finish(
        {
            "val_loss": float(val["loss"].mean),
            "val_accuracy": float(val["accuracy"].mean),
            "val_count": val["accuracy"].count,
            "confusion": confusion.tolist(),
        }
    )
    if run.is_main:
        print("confusion (rows: true digit, columns: predicted):")
        for digit, row in enumerate(confusion.tolist()):
            print(f"  {digit}: " + " ".join(f"{count:3d}" for count in row))
        keys = ("val_loss", "val_accuracy", "val_count", "global_step")
        print("RESULT " + json.dumps({key: summary[key] for key in keys}))
    return summary


if __name__ == "__main__":
    main()
