"""The iteration-based path's per-step overhead, paired: a nanoGPT-shaped loop (its own random
``get_batch``, micro-steps with the gradient sync on the last, AdamW with a learning rate from
the iteration number) written against ``run.iterations()`` with ``run.every`` and ``run.log``,
and the same loop written by hand with plain DDP, alternating single steps inside one pair of
gloo ranks as bench/interleaved.py does. Reports tokens/s for both sides and their ratio
(target >= 0.99).

Each rank runs ``python -m bench.iterations --rounds 20``; rank 0 prints JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

import hpc_ddp
from bench.harness import launch, write_result
from bench.interleaved import token_result
from bench.lm import MODEL, example

#: Windows per optimizer step over both ranks, micro-steps per step, steps per round.
BATCH = 32
ACCUM = 2
STEPS_PER_ROUND = 8
WORLD = 2


class Side:
    """One side's model, optimizer and batches: the same on both sides but for the wrapping."""

    def __init__(self, model: torch.nn.Module, tokens: torch.Tensor, seed: int) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
        self.tokens = tokens
        self.generator = torch.Generator().manual_seed(seed)

    def get_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        context, per_rank = MODEL["context"], BATCH // (WORLD * ACCUM)
        starts = torch.randint(
            len(self.tokens) - context - 1, (per_rank,), generator=self.generator
        )
        x = torch.stack([self.tokens[i : i + context] for i in starts.tolist()])
        y = torch.stack([self.tokens[i + 1 : i + 1 + context] for i in starts.tolist()])
        return x, y

    def step(self, iter_num: int, total: int, log: Callable[[torch.Tensor, int], None]) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = 1e-3 * 0.5 * (1 + math.cos(math.pi * iter_num / total))
        for micro_step in range(ACCUM):
            self.model.require_backward_grad_sync = micro_step == ACCUM - 1  # type: ignore[assignment]
            x, y = self.get_batch()
            loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
            (loss / ACCUM).backward()
            log(loss.detach() * y.numel(), y.numel())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def rank_main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, required=True)
    args = parser.parse_args()
    lm = example()
    run = hpc_ddp.start(
        name="bench-iterations",
        run={"output_dir": "/tmp/hpc-ddp-bench"},
        tracking={"enabled": False},
        checkpoint={"enabled": False},
    )
    tokens = lm.stdlib_text(False, 200_000)
    torch.manual_seed(0)
    hand = Side(DistributedDataParallel(lm.TinyGPT(**MODEL, dropout=0.0)), tokens, 1 + run.rank)
    torch.manual_seed(0)
    ours = Side(run.wrap(lm.TinyGPT(**MODEL, dropout=0.0)), tokens, 1 + run.rank)
    run.register(model=ours.model, optimizer=ours.optimizer)
    total = (args.rounds + 1) * STEPS_PER_ROUND  # round 0 warms both up and is not counted
    hand_s, ours_s = [0.0] * (args.rounds + 1), [0.0] * (args.rounds + 1)
    ours_since: float | None = None
    for iter_num in run.iterations(max_steps=total):
        now = time.perf_counter()
        round_index = iter_num // STEPS_PER_ROUND
        if ours_since is not None:  # the previous library step, its step boundary included
            ours_s[(iter_num - 1) // STEPS_PER_ROUND] += now - ours_since
        hand.step(iter_num, total, lambda total_, count: None)
        hand_s[round_index] += time.perf_counter() - now
        ours_since = time.perf_counter()
        if run.every(STEPS_PER_ROUND * 4):
            run.log_metrics({"round": float(round_index)})
        ours.step(iter_num, total, lambda loss, count: run.log("loss", loss, count))
    ours_s[-1] += time.perf_counter() - (ours_since or time.perf_counter())
    step_tokens = BATCH * MODEL["context"]
    if run.is_main:
        rates = [
            (STEPS_PER_ROUND * step_tokens / h, STEPS_PER_ROUND * step_tokens / o)
            for h, o in zip(hand_s[1:], ours_s[1:], strict=True)
        ]
        print(json.dumps({"raw": [r for r, _ in rates], "hpc_ddp": [o for _, o in rates]}))
    run.finish()


def run(rounds: int = 40) -> dict[str, Any]:
    output, _ = launch(WORLD, "bench.iterations", ["--rounds", str(rounds)], timeout=3600)
    setup = {
        "world_size": WORLD,
        "global_batch": BATCH,
        "accumulation": ACCUM,
        "model": MODEL,
        "steps_per_round": STEPS_PER_ROUND,
    }
    result = token_result("iterations", output, rounds, setup)
    write_result("iterations_paired", result)
    return result


if __name__ == "__main__":
    rank_main()
