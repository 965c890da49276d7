"""bench/README.md's GPU sections (figures taken where a GPU was lent, the GPU named)."""

from __future__ import annotations

import statistics
from typing import Any

from bench.report_steps import model_label

GPU_NOTE = """## GPU / NCCL

No GPU figures yet: the GPU machine is lent to some tasks only, and none was lent when these
figures were taken. The CUDA/NCCL path (set_device before init, device_ids, bf16 autocast,
the gloo side-group for control messages) is exercised on CPU by construction and by the
Slurm GRES tests. On a GPU, `python -m bench.gpu` takes the figures and this section shows
them; `python -m bench.gpu_sharded` adds FSDP2 with bf16 and an async folder save.
"""


def gpu_section(data: dict[str, Any]) -> str:
    single = data["nccl_single"]
    lines = [
        "## GPU / NCCL",
        "",
        f"{data['gpu']}; torch {data['torch']}, CUDA {data['cuda']}, NCCL {data['nccl']}. "
        f"One GPU, world size 1, bf16 autocast, global batch {data['global_batch']}, "
        f"{data['loader_workers']} loader workers.",
        "",
        "### NCCL path through the same entry point (`python -m hpc_ddp.train`)",
        "",
        f"backend {single['backend']}, device {single['device']}, {single['global_step']} "
        f"steps, val_loss {single['val_loss']:.4f}, val_accuracy {single['val_accuracy']:.3f}, "
        f"replicas_in_sync {single['replicas_in_sync']}, MLflow "
        f"{'not installed' if not single['tracking'] else 'run created' if single['mlflow_run_id'] else 'run MISSING'}, "
        f"{single['samples_per_s']:,.0f} samples/s (checkpoints every 100 steps included).",
        "",
        f"### Overhead on CUDA, bf16 ({data['repeats']} alternating runs per side, medians)",
        "",
        "| model | hand-written samples/s | hpc_ddp samples/s | ratio |",
        "|---|---:|---:|---:|",
    ]
    for name, row in data["overhead"].items():
        raw, hpc = (
            statistics.median(row["raw_samples_per_s"]),
            statistics.median(row["hpc_ddp_samples_per_s"]),
        )
        lines.append(
            f"| {model_label(name, row['hidden'])} | {raw:,.0f} | {hpc:,.0f} | {row['ratio']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def gpu_sharded_section(data: dict[str, Any]) -> str:
    lines = [
        "",
        f"### Training blocked per checkpoint, state on the GPU ({data['gpu']}, world size 1, "
        f"median of {data['repeats']})",
        "",
        "| state | single file | folder, at once | folder, in the background | share of at once |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in data["blocked"]:
        lines.append(
            f"| {row['size_mb']} MB | {row['single_file_s']:.2f} s | {row['sync_s']:.2f} s | "
            f"{row['async_s']:.3f} s | {100 * row['async_blocked_share']:.0f}% |"
        )
    if data.get("lm"):
        ddp, fsdp = data["lm"]
        lines += ["", f"`examples/lm/train.py` with {ddp['parameters']:,} parameters, bf16, "
                  f"{ddp['global_step']} steps, a background save every 100 steps; the last save "
                  "is the run's final one, written at once. At world size 1 FSDP2 shards nothing, "
                  f"so its per-block hooks cost {100 * (1 - fsdp['tokens_per_s'] / ddp['tokens_per_s']):.0f}% "
                  "of the tokens/s here with nothing to gain; it pays where the state does not "
                  "fit one GPU.",
                  "", "| language model | tokens/s | val loss | peak GPU memory | last save blocked |",
                  "|---|---:|---:|---:|---:|"]  # fmt: skip
        for row in data["lm"]:
            lines.append(
                f"| {row['strategy']} | {row['tokens_per_s']:,.0f} | {row['val_loss']:.4f} | "
                f"{row['gpu_peak_memory_gb']:.2f} GB | {row['last_save_blocked_s']:.3f} s |"
            )
    else:
        lines += [
            "",
            f"The DDP and FSDP2 language-model runs have no figures yet: {data['source']}.",
        ]
    return "\n".join(lines) + "\n"


def deterministic_section(data: dict[str, Any]) -> str:
    default, deterministic = data["default"], data["deterministic"]
    pairs = list(zip(data["runs"]["default"], data["runs"]["deterministic"], strict=True))
    per_run = ", ".join(f"{row['tokens_per_s']:,.0f}" for pair in pairs for row in pair)
    per_pair = [1 - fast["tokens_per_s"] / slow["tokens_per_s"] for slow, fast in pairs]
    equal = {True: "bitwise equal", False: "not equal"}
    return "\n".join([
        "",
        f"### run.deterministic=true on the GPU ({data['gpu']}, torch {data['torch']}, "
        f"{data['repeats']} alternating runs per side, medians)",
        "",
        "`examples/lm/train.py` (" + " ".join(data["lm_args"]) + ") on one local rank, bf16 "
        "autocast: its embedding's backward is one of the kernels CUDA sums with atomics.",
        "",
        "| kernels | tokens/s | final weights of its runs |",
        "|---|---:|---|",
        f"| default | {default['tokens_per_s']:,.0f} | {equal[default['runs_bitwise_equal']]} |",
        f"| run.deterministic=true | {deterministic['tokens_per_s']:,.0f} | "
        f"{equal[deterministic['runs_bitwise_equal']]} |",
        "",
        f"Cost: {100 * data['cost']:.0f}% of the tokens/s from the medians, "
        f"{100 * min(per_pair):.0f}-{100 * max(per_pair):.0f}% pair by pair (runs in order, "
        f"alternating default and deterministic: {per_run}); the default runs alone spread that "
        "much, so the figure is rough. tests/test_gpu.py pins the equality on a smaller model.",
    ]) + "\n"  # fmt: skip
