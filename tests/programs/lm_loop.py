"""An iteration-based language-model loop in nanoGPT's shape, written only against
hpc_ddp's public API: no Dataset and no DataLoader, its own random ``get_batch``, a
``while``-style loop over iterations with micro-steps inside, evaluation and a best-model
save every N iterations, and a learning rate computed from ``iter_num``.

    hpc-ddp local --nproc 2 tests/programs/lm_loop.py --max-iters 200
    sbatch slurm/train.sh tests/programs/lm_loop.py --max-iters 200

``--sampling rank`` (nanoGPT's way) draws each rank's batch from its own torch random stream,
which a resume restores; ``--sampling global`` draws the global batch from the iteration's
number, so it is the same at any world size. ``--hold-at-step N``: each rank holds after
iteration N until a stop signal reached it (``--hold-signals 2``: two of them; a second
Ctrl-C aborts in the hold) (tests/programs/holding.py).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import hpc_ddp
from tests.programs.holding import StopSignalSeen

VOCAB = 32


def corpus(length: int) -> torch.Tensor:
    """Tokens with structure to learn: a fixed next-token table, followed 80% of the time."""
    generator = torch.Generator().manual_seed(0)
    table = torch.randint(0, VOCAB, (VOCAB,), generator=generator)
    tokens = torch.empty(length, dtype=torch.long)
    tokens[0] = 0
    noise = torch.randint(0, VOCAB, (length,), generator=generator)
    follow = torch.rand(length, generator=generator) < 0.8
    for index in range(1, length):
        tokens[index] = table[tokens[index - 1]] if follow[index] else noise[index]
    return tokens


class TinyLM(nn.Module):
    """Embeddings of the last ``context`` tokens, an MLP, logits for the next token."""

    def __init__(self, context: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mlp = nn.Sequential(nn.Linear(16 * context, 64), nn.GELU(), nn.Dropout(dropout))
        self.head = nn.Linear(64, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.mlp(self.embed(x).flatten(1)))
        return logits, F.cross_entropy(logits, y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-iters", type=int, default=200)
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64, help="global batch, in windows")
    parser.add_argument("--accum", type=int, default=2, help="micro-steps per iteration")
    parser.add_argument("--context", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--sampling", choices=["rank", "global"], default="rank")
    parser.add_argument("--step-pause", type=float, default=0.0)
    parser.add_argument("--hold-at-step", type=int, default=None, help="see the docstring")
    parser.add_argument("--hold-signals", type=int, default=1, help="stop signals held for")
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--best", default="", help="where rank 0 saves the best model")
    args, overrides = parser.parse_known_args()

    run = hpc_ddp.start(overrides=overrides, params=vars(args), log_interval=args.log_interval)
    signals = StopSignalSeen() if args.hold_at_step is not None else None
    data = corpus(20_000)
    train_data, val_data = data[:18_000], data[18_000:]
    model = run.wrap(TinyLM(args.context, args.dropout))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    run.register(model=model, optimizer=optimizer)
    run.state.setdefault("best_val_loss", 1e9)
    micro_batch = args.batch // (run.world_size * args.accum)

    def get_batch(iter_num: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if args.sampling == "rank":  # nanoGPT: the rank's own random stream
            starts = torch.randint(len(train_data) - args.context, (micro_batch,))
        else:  # the global batch from the iteration, this rank's share of it
            generator = torch.Generator().manual_seed(1000 * iter_num + micro_step)
            every = torch.randint(
                len(train_data) - args.context, (args.batch,), generator=generator
            )
            share = every.view(args.accum, run.world_size, micro_batch)
            starts = share[micro_step, run.rank]
        x = torch.stack([train_data[i : i + args.context] for i in starts.tolist()])
        return x.to(run.device), train_data[starts + args.context].to(run.device)

    @torch.no_grad()
    def estimate_val_loss() -> float:
        """Every validation window once over all ranks, summed exactly."""
        model.eval()
        sums = run.sums()
        starts = torch.arange(run.rank, len(val_data) - args.context, run.world_size)
        for chunk in starts.split(256):
            x = torch.stack([val_data[i : i + args.context] for i in chunk.tolist()])
            logits, _ = model.module(x.to(run.device), val_data[chunk + args.context])
            loss = F.cross_entropy(logits, val_data[chunk + args.context], reduction="sum")
            sums.add("val_loss", loss.double(), len(chunk))
        model.train()
        return float(sums.reduce()["val_loss"].mean)

    def get_lr(iter_num: int) -> float:
        return float(args.lr) * 0.5 * (1 + math.cos(math.pi * iter_num / args.max_iters))

    for iter_num in run.iterations(max_steps=args.max_iters):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(iter_num)
        if run.every(args.eval_interval):
            val_loss = estimate_val_loss()
            run.log_metrics({"val_loss": val_loss})
            if val_loss < run.state["best_val_loss"]:
                run.state["best_val_loss"] = val_loss
                if args.best and run.is_main:
                    torch.save(model.module.state_dict(), args.best)
        for micro_step in range(args.accum):
            model.require_backward_grad_sync = micro_step == args.accum - 1
            x, y = get_batch(iter_num, micro_step)
            _logits, loss = model(x, y)
            (loss / args.accum).backward()
            run.log("loss", loss.detach() * len(x), len(x))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        time.sleep(args.step_pause)
        if signals and iter_num + 1 == args.hold_at_step:
            signals.hold(run.rank, args.hold_at_step, count=args.hold_signals)

    val_loss = estimate_val_loss()
    summary = run.finish({"val_loss": val_loss, "best_val_loss": run.state["best_val_loss"]})
    if run.is_main:
        keys = ("val_loss", "best_val_loss", "global_step", "weights_sha256")
        print("RESULT " + json.dumps({key: summary[key] for key in keys}))
        if args.best:
            print(f"best model: {Path(args.best).stat().st_size} bytes")


if __name__ == "__main__":
    main()
