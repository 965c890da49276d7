"""pytorch/examples' imagenet/main.py as docs/converting.md converts it, cut to its shape: a
ResNet (BatchNorm2d, residual blocks, a strided downsample), SGD with momentum and a StepLR
schedule, train() and validate() over loaders, top-1 accuracy, the best accuracy kept
across epochs, and ``--evaluate``. Its own process group, DDP, samplers, resume and
save_checkpoint are gone. Random images stand in for an ImageFolder, as its ``--dummy`` does.

The ResNet is torchvision's in miniature, written out here: torchvision's wheels on PyPI are
built for CUDA's torch and do not load beside the CPU build these tests run on.

    hpc-ddp local --nproc 2 tests/programs/imagenet_shape.py --epochs 2 --image-size 32
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import hpc_ddp


def parse() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description="PyTorch ImageNet Training (converted)")
    parser.add_argument("--width", default=16, type=int, help="the first block's channels")
    parser.add_argument("--epochs", default=2, type=int)
    parser.add_argument("-b", "--batch-size", default=16, type=int, help="global batch")
    parser.add_argument("--lr", "--learning-rate", default=0.1, type=float)
    parser.add_argument("--momentum", default=0.9, type=float)
    parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
    parser.add_argument("--step-size", default=1, type=int, help="StepLR: epochs per decay")
    parser.add_argument("-e", "--evaluate", action="store_true")
    parser.add_argument(
        "-p", "--print-freq", default=4, type=int, help="steps per log interval (0: about 5 s)"
    )
    parser.add_argument("--train-images", default=320, type=int)
    parser.add_argument("--val-images", default=64, type=int)
    parser.add_argument("--image-size", default=32, type=int)
    parser.add_argument("--classes", default=10, type=int)
    return parser.parse_known_args()


def main() -> None:
    args, overrides = parse()
    run = hpc_ddp.start(
        overrides=overrides, params=vars(args), log_interval=args.print_freq or None
    )
    model = run.wrap(resnet(args.width, args.classes))
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(
        model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.step_size, gamma=0.1)
    run.register(model=model, optimizer=optimizer, scheduler=scheduler)
    run.state.setdefault("best_acc1", 0.0)

    train_dataset = random_images(args.train_images, args.image_size, args.classes, seed=1)
    val_dataset = random_images(args.val_images, args.image_size, args.classes, seed=2)
    train_loader = run.train_loader(train_dataset, args.batch_size)
    val_loader = run.eval_loader(val_dataset, args.batch_size)

    if args.evaluate:
        if run.resume() is None:
            raise SystemExit("nothing to evaluate: no checkpoint for this run.id")
        evaluated = validate(run, val_loader, model, criterion)
        if run.is_main:
            print("EVALUATED " + json.dumps(evaluated))
        run.finish()
        return

    for _epoch in run.epochs(args.epochs):
        train(run, train_loader, model, criterion, optimizer)
        acc1 = validate(run, val_loader, model, criterion)["acc1"]
        scheduler.step()
        run.state["best_acc1"] = max(acc1, run.state["best_acc1"])

    summary = run.finish()
    if run.is_main:
        keys = ("global_step", "weights_sha256", "world_size")
        result: dict[str, Any] = {key: summary[key] for key in keys}
        result["best_acc1"] = run.state["best_acc1"]
        result["lr"] = optimizer.param_groups[0]["lr"]
        print("RESULT " + json.dumps(result))


class BasicBlock(nn.Module):
    """torchvision's: two 3x3 convolutions with BatchNorm, and the input added back."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + self.downsample(x))  # type: ignore[no-any-return]


def resnet(width: int, classes: int) -> nn.Module:
    """A stem, two stages of one block each (the second strided), pooling, a classifier."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, 1, 1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        BasicBlock(width, width),
        BasicBlock(width, 2 * width, stride=2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, classes),
    )


def random_images(count: int, size: int, classes: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(count, 3, size, size, generator=generator)
    labels = torch.randint(classes, (count,), generator=generator)
    return TensorDataset(images, labels)


def train(run: Any, loader: Any, model: nn.Module, criterion: nn.Module, optimizer: Any) -> None:
    model.train()
    for images, target in run.steps(loader):
        output = model(images)
        loss = criterion(output, target)
        run.log("loss", loss.detach() * len(target), len(target))
        run.log("acc1", top1_correct(output, target), len(target))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def validate(run: Any, loader: Any, model: nn.Module, criterion: nn.Module) -> dict[str, float]:
    """Top-1 accuracy and loss over the whole validation set, summed over the ranks."""
    model.eval()
    sums = run.sums()
    with torch.no_grad():
        for images, target in loader:
            output = model(images)
            sums.add("val_loss", criterion(output, target) * len(target), len(target))
            sums.add("val_acc1", top1_correct(output, target), len(target))
    means = sums.reduce()
    run.log_metrics(means)
    return {"acc1": float(means["val_acc1"].mean) * 100, "loss": float(means["val_loss"].mean)}


def top1_correct(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.argmax(dim=1) == target).sum()


if __name__ == "__main__":
    main()
