"""The language-model example's per-step overhead, paired: its loop written against the public
API (examples/lm/train.py's step: accumulation-aware no_sync, clipping, AdamW with a schedule,
two logged metrics) and the same model and step written by hand with plain DDP, alternating
single steps inside the same pair of gloo ranks, as bench/interleaved.py does for the MLP.
Reports tokens/s for both sides and their ratio (target >= 0.99).

Each rank runs ``python -m bench.lm --rounds 20``; rank 0 prints JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import hpc_ddp
from bench.harness import REPO, launch, write_result
from bench.interleaved import StepsInBetween, token_result

#: The example's default model: 0.8 M parameters, 128-token windows, 32 per step.
MODEL = {"width": 128, "layers": 4, "heads": 4, "context": 128}
BATCH = 32
#: Windows per round (one epoch of each side): 8 steps.
EPOCH_WINDOWS = 256
WORLD = 2


def example() -> ModuleType:
    """examples/lm/train.py, imported by path (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("lm_example", REPO / "examples/lm/train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def optimizer_for(model: torch.nn.Module, total_steps: int) -> tuple[Any, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / (2 * total_steps))
    return optimizer, schedule


def as_pair(windows: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets): the batch form the paired loader hands to :meth:`HandWritten.step`."""
    return (
        torch.stack([window["input"] for window in windows]),
        torch.stack([window["target"] for window in windows]),
    )


class HandWritten:
    """The same model and step with plain DDP, a DistributedSampler and a DataLoader."""

    def __init__(self, lm: ModuleType, dataset: Any, total_steps: int) -> None:
        torch.manual_seed(0)
        network = lm.TinyGPT(**MODEL, dropout=0.0)
        self.model = DistributedDataParallel(network)
        self.optimizer, self.schedule = optimizer_for(self.model, total_steps)
        self.sampler: DistributedSampler[Any] = DistributedSampler(dataset, seed=0, drop_last=True)
        per_rank = BATCH // dist.get_world_size()
        self.loader = DataLoader(
            dataset, per_rank, sampler=self.sampler, drop_last=True, collate_fn=as_pair
        )
        self.steps = 0

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1


def rank_main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, required=True)
    args = parser.parse_args()
    lm = example()
    run = hpc_ddp.start(
        name="bench-lm",
        run={"output_dir": "/tmp/hpc-ddp-bench"},
        tracking={"enabled": False},
        checkpoint={"enabled": False},
    )
    context = MODEL["context"]
    text = lm.stdlib_text(False, EPOCH_WINDOWS * context + 1)
    dataset = lm.Windows(text, context, keep_partial=False)
    rounds = args.rounds + 1  # round 0 warms both up and is not counted
    total = rounds * len(dataset) // BATCH
    hand = HandWritten(lm, dataset, total)
    model = run.wrap(lm.TinyGPT(**MODEL, dropout=0.0))
    optimizer, scheduler = optimizer_for(model, total)
    between = StepsInBetween(run.train_loader(dataset, BATCH), hand, BATCH)
    run.register(model=model, optimizer=optimizer, scheduler=scheduler)
    seconds = []
    for _epoch in run.epochs(rounds):
        started, hand_before = time.perf_counter(), between.raw_seconds
        for batch in run.steps(between):
            tokens = batch["target"].numel()
            with run.no_sync(model):
                logits = model(batch["input"])
                loss = F.cross_entropy(logits.float().flatten(0, 1), batch["target"].flatten())
                loss.backward()
            run.log("loss", loss.detach() * tokens, tokens)
            if not run.accumulating:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                run.log("grad_norm", norm.detach())
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            last_step_done = time.perf_counter()
        hand_s = between.raw_seconds - hand_before
        seconds.append((hand_s, last_step_done - started - hand_s))
    assert hand.steps == run.global_step, f"unequal steps: {hand.steps} vs {run.global_step}"
    tokens_per_round = len(between.loader.loader) * BATCH * context
    if run.is_main:
        rates = [(tokens_per_round / h, tokens_per_round / o) for h, o in seconds[1:]]
        print(json.dumps({"raw": [r for r, _ in rates], "hpc_ddp": [o for _, o in rates]}))
    run.finish()


def run(rounds: int = 20) -> dict[str, Any]:
    output, _ = launch(WORLD, "bench.lm", ["--rounds", str(rounds)], timeout=3600)
    setup = {
        "world_size": WORLD,
        "global_batch": BATCH,
        "model": MODEL,
        "steps_per_round": EPOCH_WINDOWS // BATCH,
    }
    result = token_result("lm", output, rounds, setup)
    write_result("lm_paired", result)
    return result


if __name__ == "__main__":
    rank_main()
