"""bench/README.md's sections on the step's cost: the per-step overhead against a hand-written
loop (paired, and in separate processes), the examples' loops, and start-up."""

from __future__ import annotations

from typing import Any

from bench.harness import bench_notes


def model_label(name: str, hidden: list[int]) -> str:
    return f"{name} MLP 64-{'-'.join(map(str, hidden))}-10"


def overhead_paired_section(data: dict[str, Any]) -> str:
    lines = [
        "## 1. Per-step overhead vs a hand-written DDP loop",
        "",
        f"A training loop written against hpc_ddp's public API (`run.epochs`, `run.steps`, "
        f"`run.log`) against `bench/raw_ddp.py` (DistributedSampler, DDP, SGD, "
        f"nothing else): same model, synthetic data, {data['world_size']} gloo ranks, global "
        f"batch {data['global_batch']}. hpc_ddp runs with its defaults (interval metrics and a "
        "progress line about every 5 s, stop-signal agreement about once per second, both "
        "timed over the first 20 steps) and the monitor on (each training forward timed, the "
        "wait for each batch timed, the optimizer's steps and the wait for the gradients' "
        "all-reduce timed, a reading of the machine every 10 s), tracking and "
        "checkpoints off. "
        "Target: ratio >= 0.99.",
        "",
        "### 1a. Paired, step by step in the same ranks (the measurement of record)",
        "",
        "`bench/interleaved.py`: both loops live in the same two ranks and alternate single "
        "steps; hpc_ddp's side is a user-style loop over `run.steps` on a loader that runs and "
        "times one hand-written step before each of its batches. Both sides take the same "
        "step, in the same order (forward, `zero_grad`, backward, optimizer step). Machine "
        "noise slower than a step hits both alike. Ratio = hand-written seconds / hpc_ddp seconds over all rounds (one "
        "round = one epoch of each), with a bootstrap 95% interval over rounds. The control "
        "row runs the hand-written loop against a copy of itself in hpc_ddp's place: what the "
        "method reads for no difference at all.",
        "",
        "| model | rounds x steps | hand-written samples/s | hpc_ddp samples/s | ratio | 95% interval |",
        "|---|---:|---:|---:|---:|---|",
    ]
    rows = [
        (model_label(name, data[name]["hidden"]), data[name]) for name in ("compute_bound", "tiny")
    ]
    if "tiny_train_accuracy" in data:
        rows.append(("tiny, also logging train accuracy", data["tiny_train_accuracy"]))
    if "control_tiny" in data:
        rows.append(("control: tiny, hand-written vs itself", data["control_tiny"]))
    for label, row in rows:
        steps = row["epoch_samples"] // data["global_batch"]
        low, high = row["ratio_ci95"]
        lines.append(
            f"| {label} | {row['rounds']} x {steps} | {row['raw_median']:,.0f} | "
            f"{row['hpc_ddp_median']:,.0f} | {row['ratio']:.3f} | {low:.3f}-{high:.3f} |"
        )
    points = ", ".join(f"{name} {data[name]['ratio']:.3f}" for name in ("compute_bound", "tiny"))
    lows = ", ".join(
        f"{name} {data[name]['ratio_ci95'][0]:.3f}" for name in ("compute_bound", "tiny")
    )
    missed = [name for name in ("compute_bound", "tiny") if data[name]["ratio"] < 0.99]
    verdict = (
        f"Below target: {', '.join(missed)} ({points})."
        if missed
        else f"The point figures meet the target ({points}); the lower ends of their 95% "
        f"intervals are {lows}, so a shortfall of up to that much is not ruled out."
    )
    if "tiny_train_accuracy" in data:
        cost = data["tiny"]["ratio"] - data["tiny_train_accuracy"]["ratio"]
        verdict += (
            f" Logging training accuracy as a second metric costs about {cost:.1%} of the tiny "
            "model's step (an argmax and a comparison per batch)."
        )
    ends = [data[name].get("end_of_epoch_median_s") for name in ("compute_bound", "tiny")]
    if None not in ends:
        verdict += (
            " The steps' time leaves out each epoch's end, where `run.steps` sums the epoch's "
            f"metrics over the ranks: a median {ends[0] * 1000:.1f} ms (compute_bound) and "
            f"{ends[1] * 1000:.1f} ms (tiny) per epoch."
        )
    lines += [
        "",
        f"{verdict} Samples/s columns are per-round medians; while the two loops alternate, "
        "each runs slower than alone (two models share the caches), so compare them with "
        "each other, not with 1b.",
        "",
    ]
    lines += [bench_notes("overhead_paired").removesuffix("\n")]
    separate = data.get("separate_processes")
    return "\n".join(lines) + "\n" + (_separate_processes(separate) if separate else "")


def _separate_processes(data: dict[str, Any]) -> str:
    lines = [
        "### 1b. Separate processes, alternating runs",
        "",
        f"`bench/interleaved.py` (`separate_processes`): each side in its own pair of "
        "processes, the built-in trainer against `bench/raw_ddp.py`; A/B alternating, "
        f"{data['repeats']} runs each, medians.",
        "",
        "| model | hand-written samples/s | hpc_ddp samples/s | ratio |",
        "|---|---:|---:|---:|",
    ]
    for name in ("compute_bound", "tiny"):
        row = data[name]
        lines.append(
            f"| {model_label(name, row['hidden'])} | {row['raw_median']:,.0f} | "
            f"{row['hpc_ddp_median']:,.0f} | {row['ratio']:.3f} |"
        )
    spread = max(
        max(row) / min(row) - 1
        for name in ("compute_bound", "tiny")
        for row in (data[name]["raw_samples_per_s"], data[name]["hpc_ddp_samples_per_s"])
    )
    lines += [
        "",
        f"Runs of the same side differed by up to {spread:.0%} in this set (two ranks on two "
        "shared cores), so this figure cannot resolve 1%; it is here as the whole-process "
        "check (start-up excluded) that nothing outside the loop, such as a busy thread, "
        "slows training.",
    ]
    below = [
        f"{name} {data[name]['ratio']:.3f}"
        for name in ("compute_bound", "tiny")
        if data[name]["ratio"] < 0.99
    ]
    if below:
        lines += [
            "",
            f"Below 0.99 here: {', '.join(below)}. Earlier sets of this kind read from 0.956 "
            "to 1.022 for unchanged code (the built-in trainer: compute_bound 0.956 and 1.020, "
            "tiny 1.022), a swing of several percent either way: the paired figure (1a) is the "
            "one that resolves 1%.",
        ]
    return "\n".join(lines) + "\n\n"


def lm_section(data: dict[str, Any]) -> str:
    model = data["model"]
    low, high = data["ratio_ci95"]
    return (
        "\n".join(
            [
                "### 1c. The language-model example, paired",
                "",
                "`bench/lm.py`: examples/lm/train.py's step against the same model and step "
                "written by hand with plain DDP, alternating single steps in one pair of gloo "
                f"ranks as in 1a. Transformer width {model['width']}, {model['layers']} layers, "
                f"{model['heads']} heads, {model['context']}-token windows, global batch "
                f"{data['global_batch']} ({data['global_batch'] * model['context']:,} tokens per "
                f"step); {data['rounds']} rounds of {data['steps_per_round']} steps.",
                "",
                "| hand-written tokens/s | hpc_ddp tokens/s | ratio (95% interval) |",
                "|---:|---:|---:|",
                f"| {data['raw_tokens_per_s_median']:,.0f} | {data['hpc_ddp_tokens_per_s_median']:,.0f} "
                f"| **{data['ratio']:.3f}** ({low:.3f}-{high:.3f}) |",
                "",
                "The hpc_ddp side also logs two metrics per step (loss over tokens, gradient "
                "norm) and agrees on stops; the hand-written side does neither. A reading "
                "above 1 is the method's own spread (the control in 1a reads 1.005 for "
                "identical code), not hpc_ddp making the model faster: the figure says the "
                "library costs nothing this method can see.",
                "",
            ]
        )
        + "\n"
    )


def iterations_section(data: dict[str, Any]) -> str:
    model = data["model"]
    low, high = data["ratio_ci95"]
    return (
        "\n".join(
            [
                "### 1d. An iteration-based loop (nanoGPT's shape), paired",
                "",
                "`bench/iterations.py`: a loop over `run.iterations()` that draws its own random "
                "batches, with micro-steps (the gradient sync on the last), `run.every` and "
                "`run.log`, against the same loop written by hand with plain DDP, alternating "
                f"single steps in one pair of gloo ranks as in 1a. The 1c model, "
                f"{data['accumulation']} micro-steps per step, global batch "
                f"{data['global_batch']} windows of {model['context']} tokens; "
                f"{data['rounds']} rounds of {data['steps_per_round']} steps.",
                "",
                "| hand-written tokens/s | hpc_ddp tokens/s | ratio (95% interval) |",
                "|---:|---:|---:|",
                f"| {data['raw_tokens_per_s_median']:,.0f} | "
                f"{data['hpc_ddp_tokens_per_s_median']:,.0f} "
                f"| **{data['ratio']:.3f}** ({low:.3f}-{high:.3f}) |",
                "",
            ]
        )
        + "\n"
    )


def startup_section(data: dict[str, Any]) -> str:
    stages = data["stages_with_mlflow_median_s"]
    return (
        "\n".join(
            [
                "## 2. Start-up: process start to the first finished step (2 ranks)",
                "",
                "| | seconds (median) |",
                "|---|---:|",
                f"| bare script (imports, init_process_group, one step) | {data['bare_median_s']:.2f} |",
                f"| hpc_ddp, tracking off | {data['hpc_ddp_median_s']:.2f} |",
                f"| hpc_ddp, MLflow on (rank 0 imports mlflow, creates the run) | "
                f"{data['hpc_ddp_with_mlflow_median_s']:.2f} |",
                "",
                "Where hpc_ddp's time goes (MLflow on; seconds after the processes were spawned): "
                + ", ".join(
                    f"{name.replace('_', ' ')} {value:.2f}"
                    for name, value in sorted(stages.items(), key=lambda item: item[1])
                )
                + ". `entry` is after Python, torch and hpc_ddp imported and the config "
                "resolved; MLflow starts in a background thread at the first log interval, so it "
                "is off this path. Target: within 0.5 s of the bare script.",
            ]
        )
        + "\n\n"
    )
