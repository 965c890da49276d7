"""Benchmark 1: hpc_ddp's training step vs a minimal hand-written DDP loop.

Same model, data, world size (2 CPU gloo ranks) and global batch; A and B alternate over
several runs; the figure is the median samples/s and their ratio (target >= 0.99).
"""

from __future__ import annotations

from typing import Any

from bench.harness import launch, median, write_result

MODELS: dict[str, dict[str, Any]] = {
    "compute_bound": {"hidden": [1024, 1024], "samples": 32768, "epochs": 3},
    "tiny": {"hidden": [32], "samples": 131072, "epochs": 4},
}
BATCH = 256
WORLD = 2


def hpc_ddp_args(hidden: list[int], samples: int, epochs: int) -> list[str]:
    return [
        "--config",
        "configs/synthetic.yaml",
        f"model.hidden_sizes={hidden}",
        f"data.num_samples={samples}",
        f"data.batch_size={BATCH}",
        f"train.epochs={epochs}",
        "optim.name=sgd",
        "optim.lr=0.05",
        "optim.momentum=0.9",
        "optim.weight_decay=0",
        "optim.schedule=constant",
        "optim.warmup_steps=0",
        "optim.grad_clip_norm=null",
        "tracking.enabled=false",
        "checkpoint.enabled=false",
        "run.output_dir=/tmp/hpc-ddp-bench",
    ]


def raw_args(hidden: list[int], samples: int, epochs: int) -> list[str]:
    return [
        "--hidden",
        *map(str, hidden),
        "--samples",
        str(samples),
        "--batch",
        str(BATCH),
        "--epochs",
        str(epochs),
    ]


def run(repeats: int = 5) -> dict[str, Any]:
    results: dict[str, Any] = {"world_size": WORLD, "global_batch": BATCH, "repeats": repeats}
    for name, model in MODELS.items():
        hpc, raw = [], []
        for _ in range(repeats):
            raw.append(launch(WORLD, "bench.raw_ddp", raw_args(**model))[0]["samples_per_s"])
            hpc.append(launch(WORLD, "hpc_ddp.train", hpc_ddp_args(**model))[0]["samples_per_s"])
        results[name] = {
            "hidden": model["hidden"],
            "raw_samples_per_s": raw,
            "hpc_ddp_samples_per_s": hpc,
            "raw_median": median(raw),
            "hpc_ddp_median": median(hpc),
            "ratio": median(hpc) / median(raw),
        }
        print(
            f"{name}: raw {median(raw):,.0f} samples/s, hpc_ddp {median(hpc):,.0f} "
            f"samples/s, ratio {median(hpc) / median(raw):.3f}",
            flush=True,
        )
    write_result("overhead", results)
    return results


if __name__ == "__main__":
    run()
