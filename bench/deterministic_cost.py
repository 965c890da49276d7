"""What run.deterministic=true costs on a GPU, and whether it makes two runs equal; needs a
CUDA GPU (none: exits 2 and says so).

The language-model example on one local rank (bf16 autocast, dropout, its embedding's
backward being one of the kernels CUDA sums with atomics): alternating runs with the default
kernels and with ``run.deterministic=true``, tokens/s and the final weights' sha256 of each.

    python -m bench.deterministic_cost [REPEATS] && python -m bench.report
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.gpu import gpu_or_refusal
from bench.harness import lm_example_summary, median, write_result

LM_ARGS = ["--epochs", "1", "--batch", "64", "--context", "256", "--width", "512",
           "--layers", "8", "--heads", "8", "--dropout", "0.1", "--train-bytes", "4000000",
           "--sample-bytes", "0"]  # fmt: skip
MODES = {"default": "false", "deterministic": "true"}


def lm_run(mode: str, run_id: str, output_dir: Path) -> dict[str, Any]:
    """One run of examples/lm/train.py on one local rank; its tokens/s and final weights."""
    settings = [f"run.deterministic={MODES[mode]}", "tracking.enabled=false",
                "checkpoint.enabled=false"]  # fmt: skip
    summary = lm_example_summary([*LM_ARGS, *settings], run_id, output_dir)
    return {key: summary.get(key) for key in ("tokens_per_s", "weights_sha256", "val_loss",
                                                "global_step", "device")}  # fmt: skip


def run(repeats: int = 2) -> dict[str, Any] | None:
    if repeats < 2:
        raise SystemExit("bench.deterministic_cost: error: REPEATS must be 2 or more (whether "
                         "two runs end equal needs two runs)")  # fmt: skip
    facts = gpu_or_refusal("bench.deterministic_cost")
    if facts is None:
        return None
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as output_dir:
        for repeat in range(repeats):
            for mode in MODES:
                row = lm_run(mode, f"{mode}-{repeat}", Path(output_dir))
                print(f"{mode} {repeat}: {row}", flush=True)
                runs[mode].append(row)
    result = {**facts, "repeats": repeats, "lm_args": LM_ARGS, "runs": runs}
    for mode, rows in runs.items():
        result[mode] = {
            "tokens_per_s": median([row["tokens_per_s"] for row in rows]),
            "runs_bitwise_equal": len({row["weights_sha256"] for row in rows}) == 1,
        }
    result["cost"] = 1 - result["deterministic"]["tokens_per_s"] / result["default"]["tokens_per_s"]
    write_result("deterministic_cost", result)
    return result


if __name__ == "__main__":
    outcome = run(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    sys.exit(2 if outcome is None else 0)
