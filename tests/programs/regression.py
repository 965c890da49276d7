"""A user's own training script, written only against hpc_ddp's public API.

Regression (not classification): dict batches {"x", "y"}, a mean-squared-error loss, SGD
with a LambdaLR schedule, gradient accumulation, and a user object that is checkpointed
with the rest. Runs under every launcher:

    hpc-ddp local --nproc 2 tests/programs/regression.py --epochs 2
    sbatch slurm/train.sh tests/programs/regression.py --epochs 2

``--hold-at-step N``: each rank holds after step N (where its attempt takes it) until a signal
reached it, or (``--hold-until FILE``) until the file exists (tests/programs/holding.py).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

import hpc_ddp
from tests.programs.holding import FileAppears, StopSignalSeen


class Pairs(Dataset[dict[str, torch.Tensor]]):
    """y = tanh(x @ A) @ B + noise: one fixed A and B; x and the noise drawn from ``seed``."""

    def __init__(self, size: int, seed: int) -> None:
        teacher = torch.Generator().manual_seed(0)
        mixing = torch.randn(8, 16, generator=teacher) / 8**0.5
        readout = torch.randn(16, 2, generator=teacher) / 16**0.5
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 8, generator=generator)
        self.y = torch.tanh(self.x @ mixing) @ readout + 0.05 * torch.randn(
            size, 2, generator=generator
        )

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "y": self.y[index], "id": torch.tensor(index)}


class BestLoss:
    """The user's own checkpointed state: the lowest validation loss seen so far."""

    def __init__(self) -> None:
        self.value = float("inf")

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


def evaluate(run: hpc_ddp.Run, model: nn.Module, loader: Any) -> hpc_ddp.Sum:
    """Mean squared error over every validation sample exactly once, summed in float64."""
    sums = run.sums()
    model.eval()
    with torch.no_grad():
        for batch in loader:
            errors = (model(batch["x"]) - batch["y"]).double().pow(2).sum(dim=1)
            sums.add("mse", errors.sum(), len(errors))
    model.train()
    return sums.reduce()["mse"]


def record_ids(folder: str, run: hpc_ddp.Run, ids: torch.Tensor) -> None:
    """One line per micro-batch: the optimizer step it belongs to and its sample ids."""
    with open(f"{folder}/ids-{run.job_id}-rank{run.rank}.jsonl", "a") as record:
        record.write(json.dumps({"step": run.global_step, "ids": ids.tolist()}) + "\n")


def own_init(model: nn.Module) -> None:
    """A script's own initialisation, as torchtitan's init_weights: its own distributions."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.5)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.BatchNorm1d):
            module.reset_parameters()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=96, help="global batch")
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--samples", type=int, default=4800)
    parser.add_argument("--log-interval", type=int, default=None, help="steps between logs")
    parser.add_argument("--record-ids", default=None, help="folder: each rank's sample ids")
    parser.add_argument("--step-pause", type=float, default=0.0, help="seconds: a slower step")
    parser.add_argument("--hold-at-step", type=int, default=None, help="see the docstring")
    parser.add_argument("--hold-until", default=None, help="held until this file exists")
    parser.add_argument("--clip", type=float, default=None, help="gradient norm clipped to")
    parser.add_argument(
        "--shard-by-hand", action="store_true", help="FSDP2 by the script's own fully_shard"
    )
    parser.add_argument("--batchnorm", action="store_true", help="a BatchNorm layer in the net")
    parser.add_argument(
        "--own-ddp", action="store_true", help="the script's own DistributedDataParallel"
    )
    parser.add_argument(
        "--meta", action="store_true", help="the net built on the meta device (no data)"
    )
    parser.add_argument(
        "--init-weights", action="store_true", help="--meta: run.wrap(init_weights=...)"
    )
    args, overrides = parser.parse_known_args(argv)  # the rest: hpc_ddp's dotted overrides

    run = hpc_ddp.start(
        overrides=overrides,
        params=vars(args),
        fingerprint={"batch": args.batch, "lr": args.lr, "samples": args.samples},
        log_interval=args.log_interval,
    )
    holding = None
    if args.hold_at_step is not None:
        holding = FileAppears(args.hold_until) if args.hold_until else StopSignalSeen()
    if args.meta and (args.shard_by_hand or args.own_ddp):
        raise SystemExit("--meta: for run.wrap's model only")
    norm = [nn.BatchNorm1d(32)] if args.batchnorm else []
    with torch.device("meta" if args.meta else "cpu"):
        net = nn.Sequential(nn.Linear(8, 32), *norm, nn.Tanh(), nn.Linear(32, 2))
    if args.shard_by_hand:  # as a script written for FSDP2 without hpc_ddp does it
        from torch.distributed.fsdp import fully_shard

        for layer in (net[0], net[-1]):
            fully_shard(layer)
        fully_shard(net)
        model: nn.Module = net
    elif args.own_ddp:  # as a script converted from the DDP tutorial keeps it
        model = nn.parallel.DistributedDataParallel(net)
    else:
        model = run.wrap(net, init_weights=own_init if args.init_weights else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = run.train_loader(Pairs(args.samples, seed=1), args.batch, grad_accum_steps=args.accum)
    val_loader = run.eval_loader(Pairs(1001, seed=2), batch_size=256)
    total = args.epochs * loader.steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / total)
    best = BestLoss()
    run.register(model=model, optimizer=optimizer, scheduler=scheduler, best=best)
    # The initial weights are the same at any world size, so this must be too, exactly.
    initial = evaluate(run, run.unwrap(model), val_loader) if run.resume() is None else None

    for _epoch in run.epochs(args.epochs):
        for batch in run.steps(loader):
            with run.accumulate(model):
                loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
                if not torch.isfinite(loss):  # a learning rate too high, as users meet it
                    raise FloatingPointError(f"loss {loss.item()} at step {run.global_step}")
                (loss / args.accum).backward()
            run.log("mse", loss.detach() * len(batch["x"]), len(batch["x"]))
            if args.record_ids:
                record_ids(args.record_ids, run, batch["id"])
            if not run.accumulating:
                if args.clip is not None:
                    run.clip_grad_norm_(model.parameters(), args.clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                time.sleep(args.step_pause)
                if holding and run.global_step + 1 == args.hold_at_step:
                    holding.hold(run.rank, args.hold_at_step)
        val = evaluate(run, run.unwrap(model), val_loader)
        best.value = min(best.value, float(val.mean))
        run.log_metrics({"val_mse": val.mean})

    summary = run.finish(
        {
            "val_mse": float(val.mean),
            "val_count": val.count,
            "best_val_mse": best.value,
            "initial_val_mse": float(initial.mean) if initial else None,
        }
    )
    if run.is_main:
        keys = ("val_mse", "val_count", "initial_val_mse", "global_step")
        print("RESULT " + json.dumps({key: summary[key] for key in keys}))
    return summary


if __name__ == "__main__":
    main()
