"""GPU figures for checkpoints and FSDP2; needs a CUDA GPU (none: exits 2 and says so).

1. How long training is blocked per checkpoint when the state lives on the GPU (world size
   1, 256 MB to 4 GB): the single file (``torch.save`` copies each tensor to the host while
   the job waits), a torch.distributed.checkpoint folder written at once, and one written in
   the background (blocked only while the state is copied into pinned host buffers).
2. The language-model example on the GPU, DDP against FSDP2 (``--fsdp``), bf16, with a
   background save every 100 steps: tokens/s, validation loss, peak GPU memory and what the
   last save blocked, from each run's summary.json.

    python -m bench.gpu_sharded [REPEATS] && python -m bench.report  # results/gpu_sharded.json
    python -m bench.gpu_sharded lm   # part 2 alone; part 1's figures stay as recorded
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.gpu import gpu_or_refusal
from bench.harness import REPO, launch, lm_example_summary, write_result

SIZES_MB = (256, 1024, 2048, 4096)
#: Larger than the example's default, so that the GPU's work and not Python sets the pace.
LM_ARGS = ["--epochs", "1", "--batch", "64", "--context", "256", "--width", "512",
           "--layers", "8", "--heads", "8", "--train-bytes", "8000000"]  # fmt: skip
LM_SETTINGS = ["checkpoint.every_steps=100", "checkpoint.save_mode=async", "tracking.enabled=false"]


def lm_run(strategy: str, output_dir: Path) -> dict[str, Any]:
    """One run of examples/lm/train.py on one local rank; the facts of its summary.json."""
    flags = ["--fsdp"] if strategy == "fsdp" else []
    summary = lm_example_summary([*LM_ARGS, *flags, *LM_SETTINGS], strategy, output_dir)
    keys = ("device", "backend", "global_step", "val_loss", "tokens_per_s", "parameters",
            "gpu_peak_memory_gb")  # fmt: skip
    # The summary holds the last save's phases (its final save, at once); their sum is what
    # training waited for.
    phases = summary.get("last_checkpoint_save_s") or {}
    return {
        "strategy": strategy,
        **{key: summary.get(key) for key in keys},
        "last_save_blocked_s": round(sum(phases.values()), 4),
        "last_save_phases_s": phases,
    }


def language_models(
    facts: dict[str, Any], repeats: int, blocked: list[dict[str, Any]]
) -> dict[str, Any]:
    """Part 2: the DDP and FSDP2 runs, recorded beside part 1's rows."""
    with tempfile.TemporaryDirectory() as output_dir:
        lm = [lm_run(strategy, Path(output_dir)) for strategy in ("ddp", "fsdp")]
    for row in lm:
        print(f"lm {row}", flush=True)
    result = {**facts, "repeats": repeats, "blocked": blocked, "lm": lm}
    write_result("gpu_sharded", result)
    return result


def run(repeats: int = 3) -> dict[str, Any] | None:
    facts = gpu_or_refusal("bench.gpu_sharded")
    if facts is None:
        return None
    sizes = ",".join(map(str, SIZES_MB))
    arguments = ["blocked", "--device", "cuda", "--sizes", sizes, "--repeats", str(repeats)]
    blocked = launch(1, "bench.sharded", arguments, timeout=1800)[0]["rows"]
    for row in blocked:
        print(f"{row['size_mb']:5d} MB on the GPU: blocked single file {row['single_file_s']:.2f}"
              f" s, DCP sync {row['sync_s']:.2f} s, DCP async {row['async_s']:.3f} s "
              f"({100 * row['async_blocked_share']:.0f}% of sync)", flush=True)  # fmt: skip
    # Written now too: the figures above stay if the runs below are cut short.
    write_result("gpu_sharded", {**facts, "repeats": repeats, "blocked": blocked, "lm": None,
                                 "source": "the language-model runs did not finish"})  # fmt: skip
    return language_models(facts, repeats, blocked)


def run_language_models_only() -> dict[str, Any] | None:
    facts = gpu_or_refusal("bench.gpu_sharded")
    if facts is None:
        return None
    recorded = json.loads((REPO / "bench" / "results" / "gpu_sharded.json").read_text())
    return language_models(facts, recorded["repeats"], recorded["blocked"])


if __name__ == "__main__":
    if sys.argv[1:] == ["lm"]:
        sys.exit(0 if run_language_models_only() is not None else 2)
    sys.exit(0 if run(int(sys.argv[1]) if len(sys.argv) > 1 else 3) is not None else 2)
