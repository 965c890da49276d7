"""Benchmark 1, paired: hpc_ddp's loop and the hand-written loop taking turns, step by step,
inside the same pair of ranks.

Separate processes on a shared machine drift by several percent from run to run, more than
the 1% this benchmark has to resolve. Here both loops live in one pair of gloo ranks (same
processes, threads and moment) and alternate single steps: hpc_ddp's real Trainer runs its
epoch (``Trainer.fit``, the code `hpc-ddp local` and srun run) over a loader that, before
handing it each batch, runs one step of the hand-written loop and times it. Machine noise
slower than a step then hits both sides alike and cancels.

hpc_ddp's time is its loop's own ``train_time_s`` (as in summary.json) minus the hand-written
steps run inside it, so it holds everything hpc_ddp does per step and per epoch except
validation (which the hand-written loop does not do). Each round is one epoch of both.

The control (``--control``) puts a second copy of the hand-written loop where hpc_ddp's was:
its ratio shows what this method reads when both sides are the same code (ideally 1.000).

Each rank runs ``python -m bench.interleaved --model tiny --rounds 30``; rank 0 prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from bench.harness import launch, write_result
from bench.overhead import BATCH, MODELS, WORLD, hpc_ddp_args
from bench.raw_ddp import RawLoop
from hpc_ddp.checkpoint import resume_fingerprint
from hpc_ddp.config import load_config
from hpc_ddp.data import build_datasets
from hpc_ddp.dist import init_distributed, shutdown_distributed
from hpc_ddp.logs import setup_logging
from hpc_ddp.loop import Trainer
from hpc_ddp.models import build_model
from hpc_ddp.tracking import NullTracker
from hpc_ddp.train import resolve

#: Samples per epoch (100 steps of the tiny model, 32 of the compute-bound one).
EPOCH_SAMPLES = {"compute_bound": 8192, "tiny": 25600}
#: Rounds per model: single steps at 2 ranks on 2 shared cores vary a lot (ranks wait for
#: each other at every all-reduce), so the tiny model needs tens of thousands of steps.
ROUNDS = {"compute_bound": 60, "tiny": 300}
#: Rounds for the control and for the train-accuracy option's cost.
CONTROL_ROUNDS = 150


def build_trainer(hidden: list[int], samples: int, overrides: list[str]) -> Trainer:
    arguments = hpc_ddp_args(hidden, samples, epochs=1)
    config = load_config(arguments[1], [*arguments[2:], "data.num_val_samples=256", *overrides])
    plan = resolve(config, os.environ)
    setup_logging(plan.dist_env.rank, plan.dist_env.world_size)
    init_distributed(plan.dist_env, plan.device, config.dist)
    group = dist.new_group(backend="gloo")
    datasets = build_datasets(config)
    torch.manual_seed(config.run.seed)
    model = build_model(config, datasets.num_features, datasets.num_classes)
    return Trainer(config, plan, datasets, model, NullTracker(), None, group)


class StepsInBetween:
    """A loader that runs one timed hand-written step before handing out each batch."""

    def __init__(self, loader: Any, raw: RawLoop) -> None:
        self.loader = loader
        self.raw = raw
        self.epoch = 0
        self.raw_seconds = 0.0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        started = time.perf_counter()
        self.raw.sampler.set_epoch(self.epoch)
        raw_batches = iter(self.raw.loader)
        self.raw_seconds += time.perf_counter() - started
        batches = iter(self.loader)
        for _ in range(len(self.loader)):
            # Each side's batch is fetched right before its own step: a rank waits at a step's
            # all-reduce for the other rank's work since the previous all-reduce, and the
            # fetch is the most variable part of that work, so it must sit on its own side.
            started = time.perf_counter()
            self.raw.step(*next(raw_batches))
            self.raw_seconds += time.perf_counter() - started
            yield next(batches)


def hpc_ddp_round(
    trainer: Trainer, between: StepsInBetween, fingerprint: dict[str, str]
) -> tuple[float, float]:
    """One epoch of both loops: (hand-written seconds, hpc_ddp seconds)."""
    train_before, raw_before = trainer.state.train_time_s, between.raw_seconds
    trainer.total_steps = trainer.state.global_step + trainer.steps_per_epoch
    trainer.fit(fingerprint)
    between.epoch += 1
    raw_seconds = between.raw_seconds - raw_before
    return raw_seconds, trainer.state.train_time_s - train_before - raw_seconds


def control_round(second: RawLoop, between: StepsInBetween) -> tuple[float, float]:
    """One epoch of the hand-written loop against its own copy, in hpc_ddp's place."""
    raw_before = between.raw_seconds
    second.sampler.set_epoch(between.epoch)
    started = time.perf_counter()
    for features, labels in between:
        second.step(features, labels)
    elapsed = time.perf_counter() - started
    between.epoch += 1
    raw_seconds = between.raw_seconds - raw_before
    return raw_seconds, elapsed - raw_seconds


def rank_main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--control", action="store_true", help="hand-written vs itself")
    parser.add_argument("--set", action="append", default=[], help="hpc_ddp config override")
    args = parser.parse_args()
    hidden = MODELS[args.model]["hidden"]
    samples = EPOCH_SAMPLES[args.model]
    trainer = build_trainer(hidden, samples, args.set)
    fingerprint = resume_fingerprint(trainer.config)
    raw = RawLoop(hidden, samples, BATCH)
    second = RawLoop(hidden, samples, BATCH) if args.control else None
    assert len(raw.loader) == trainer.steps_per_epoch, "both loops must take the same steps"
    between = StepsInBetween(second.loader if second else trainer.loader, raw)
    trainer.loader = between
    seconds: list[tuple[float, float]] = []
    for round_index in range(args.rounds + 1):  # round 0 warms both up and is not counted
        if second is not None:
            pair = control_round(second, between)
        else:
            pair = hpc_ddp_round(trainer, between, fingerprint)
        if round_index:
            seconds.append(pair)
    other_steps = second.steps if second else trainer.state.global_step
    assert raw.steps == other_steps, f"unequal steps: {raw.steps} vs {other_steps}"
    if trainer.plan.dist_env.is_main:
        samples_per_round = trainer.steps_per_epoch * BATCH
        print(
            json.dumps(
                {
                    "raw": [samples_per_round / raw_s for raw_s, _ in seconds],
                    "hpc_ddp": [samples_per_round / other_s for _, other_s in seconds],
                }
            )
        )
    shutdown_distributed()


def overall_ratio(raw: list[float], hpc: list[float]) -> float:
    """hpc_ddp's samples/s over the hand-written loop's, over all rounds (total times)."""
    return sum(1 / rate for rate in raw) / sum(1 / rate for rate in hpc)


def summarise(raw: list[float], hpc: list[float]) -> dict[str, Any]:
    """The overall ratio with a bootstrap 95% interval over rounds, and the per-round spread."""
    ratios = [h / r for h, r in zip(hpc, raw, strict=True)]
    quartiles = statistics.quantiles(ratios, n=4)
    sampler = random.Random(0)
    indices = range(len(raw))
    resampled = sorted(
        overall_ratio([raw[i] for i in picks], [hpc[i] for i in picks])
        for picks in (sampler.choices(indices, k=len(raw)) for _ in range(2000))
    )
    return {
        "raw_samples_per_s": raw,
        "hpc_ddp_samples_per_s": hpc,
        "raw_median": statistics.median(raw),
        "hpc_ddp_median": statistics.median(hpc),
        "ratio": overall_ratio(raw, hpc),
        "ratio_ci95": [resampled[50], resampled[1949]],
        "round_ratio_median": statistics.median(ratios),
        "round_ratio_quartiles": [quartiles[0], quartiles[2]],
    }


def measure(
    name: str, rounds: int, control: bool = False, overrides: tuple[str, ...] = ()
) -> dict[str, Any]:
    arguments = ["--model", name, "--rounds", str(rounds)] + (["--control"] if control else [])
    for override in overrides:
        arguments += ["--set", override]
    output, _ = launch(WORLD, "bench.interleaved", arguments, timeout=3600)
    row = summarise(output["raw"], output["hpc_ddp"])
    low, high = row["ratio_ci95"]
    label = name + (" control" if control else "") + "".join(f" {o}" for o in overrides)
    print(
        f"{label} (paired, {rounds} rounds): ratio "
        f"{row['ratio']:.3f} (95% CI {low:.3f}-{high:.3f})",
        flush=True,
    )
    return {"rounds": rounds, "epoch_samples": EPOCH_SAMPLES[name], "overrides": overrides, **row}


def run() -> dict[str, Any]:
    results: dict[str, Any] = {"world_size": WORLD, "global_batch": BATCH}
    for name, model in MODELS.items():
        results[name] = {"hidden": model["hidden"], **measure(name, ROUNDS[name])}
    results["control_tiny"] = measure("tiny", CONTROL_ROUNDS, control=True)
    results["tiny_train_accuracy"] = measure(
        "tiny", CONTROL_ROUNDS, overrides=("train.train_accuracy=true",)
    )
    write_result("overhead_paired", results)
    return results


if __name__ == "__main__":
    rank_main()
