"""bench/README.md's sections on scale (bench/scale.py) and tracking's cost
(bench/tracking_cost.py), and the plot bench/scale.png."""

from __future__ import annotations

import statistics
from typing import Any

from bench.harness import REPO, bench_notes

PLOT = REPO / "bench" / "scale.png"
#: Start-up phases, each the time from the previous mark to this one (latest rank's marks,
#: since every rank must pass a phase before any can finish the first step).
PHASES = (
    ("srun start", None, "process_start"),
    ("imports", "process_start", "entry"),
    ("rendezvous", "entry", "rendezvous"),
    ("process groups", "rendezvous", "control_group"),
    ("data + model", "control_group", "training"),
    ("first step", "training", "first_step"),
)


def startup_phases(row: dict[str, Any]) -> dict[str, float]:
    """Seconds of each start-up phase of one world size's run (see PHASES)."""
    latest = row["latest_rank"]
    phases = {}
    for name, begin, end in PHASES:
        start = 0.0 if begin is None else latest[begin]
        stop = row["rank0"]["first_step"] if end == "first_step" else latest[end]
        phases[name] = max(0.0, stop - start)
    return phases


def plot(data: dict[str, Any]) -> None:
    from matplotlib.figure import Figure

    sizes = sorted(int(w) for w in data["by_world_size"])
    rows = [data["by_world_size"][str(w)] for w in sizes]
    figure = Figure(figsize=(10, 4.2))
    left, right = figure.subplots(1, 2)
    bottom = [0.0] * len(sizes)
    for name, _begin, _end in PHASES:
        heights = [startup_phases(row)[name] for row in rows]
        left.bar([str(w) for w in sizes], heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    left.set(xlabel="world size (ranks)", ylabel="seconds", title="job start to first step")
    left.legend(fontsize=8)
    curves = {
        "stop: all ranks out": [r["stop"]["all_ranks_stopped_s"] for r in rows],
        "stop: checkpoint on disk": [r["stop"]["checkpoint_on_disk_s"] for r in rows],
        "end of run": [sum(r["ending_s"].values()) for r in rows],
        "checkpoint save": [sum(r["checkpoint_save_s"].values()) for r in rows],
    }
    for (label, values), style in zip(curves.items(), ("o-", "o--", "s-", "^-"), strict=True):
        right.plot(sizes, values, style, label=label)
    right.set(xscale="log", xlabel="world size (ranks)", ylabel="seconds", title="stop, save, end")
    right.set_xticks(sizes, [str(w) for w in sizes])
    right.legend(fontsize=8)
    figure.suptitle(f"{data['nodes']} Slurm nodes on {data['cores']} cores: every rank shares them")
    figure.tight_layout()
    figure.savefig(PLOT, dpi=90)


def scale_section(data: dict[str, Any]) -> str:
    sizes = sorted(int(w) for w in data["by_world_size"])
    lines = [
        "## 5. Scale: start-up, stop, checkpoint and end vs the number of ranks",
        "",
        f"`python -m bench.scale` after `make cluster-up NODES=16`: `sbatch slurm/train.sh` on "
        f"the test cluster ({data['nodes']} Slurm nodes, 2 ranks per node), the built-in trainer "
        "on a tiny synthetic problem (MLP 64-16-10, 32 samples per rank and step). All ranks "
        f"share this machine's {data['cores']} cores, so every CPU-bound phase grows about as "
        "W/cores here; on a cluster each rank has its own cores and those phases stay flat. "
        "What grows on one rank whatever the cores is what the section after the table is about.",
        "",
        "![scale](scale.png)",
        "",
        "Start-up, seconds from the batch script's start (the latest rank's marks: every "
        "rank must pass a phase before the first step can finish):",
        "",
        "| W | srun start | imports | rendezvous | process groups | data + model | first step "
        "| total |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for world in sizes:
        phases = startup_phases(data["by_world_size"][str(world)])
        cells = " | ".join(f"{phases[name]:.2f}" for name, _b, _e in PHASES)
        lines.append(f"| {world} | {cells} | {sum(phases.values()):.1f} |")
    lines += [
        "",
        "Stop (`scancel --signal=USR1` to the checkpoint on disk, and to the job out of "
        "RUNNING), the last checkpoint's save by phase, the run's end by phase (rank 0), and "
        "rank 0's peak memory and open sockets at the end:",
        "",
        "| W | stop: checkpoint | stop: all out | save: replica check / gather / write / "
        "barrier | end: final checkpoint / summary / close | rank 0 MiB | sockets |",
        "|---:|---:|---:|---|---|---:|---:|",
    ]
    for world in sizes:
        row = data["by_world_size"][str(world)]
        save, end, stop = row["checkpoint_save_s"], row["ending_s"], row["stop"]
        lines.append(
            f"| {world} | {stop['checkpoint_on_disk_s']:.1f} | {stop['all_ranks_stopped_s']:.1f} "
            f"| {sum(save.values()):.2f} = {save['replica_check']:.2f} / "
            f"{save['gather_state']:.2f} / {save['write']:.2f} / {save['barrier']:.2f} "
            f"| {sum(end.values()):.2f} = {end['final_checkpoint']:.2f} / {end['summary']:.2f} "
            f"/ {end['close']:.2f} | {row['peak_rss_mib']:.0f} | {row['open_sockets']} |"
        )
    eager = data.get("eager_gloo")
    if eager is not None:
        lazy = data["by_world_size"][str(eager["world_size"])]
        latest = lazy["latest_rank"]
        lines += [
            "",
            f"The same short run at W={eager['world_size']} with torch's default gloo set-up "
            "(`TORCH_GLOO_LAZY_INIT=0`: every pair of ranks connected when a group is made): "
            f"process groups {eager['process_groups_s']:.2f} s (lazy: "
            f"{latest['control_group'] - latest['rendezvous']:.2f} s), rank 0's sockets "
            f"{eager['open_sockets']} (lazy: {lazy['open_sockets']}).",
        ]
    return "\n".join(lines) + "\n\n" + bench_notes("scale")


def tracking_section(data: dict[str, Any]) -> str:
    added = 100 * data["added_fraction"]
    return (
        "## 6. Tracking's end-to-end cost\n\n"
        "`python -m bench.tracking_cost`: a 2-rank, 12-epoch synthetic run (MLP 64-256-256-10, "
        "20,000 samples, global batch 256, SGD, no checkpoints) with tracking off and with the "
        f"default embedded MLflow store (existing), alternating, {data['repeats']} runs each, "
        "medians of the whole-process wall time. Targets: at most +10% wall, at most 0.5 s at "
        "the run's end.\n\n"
        "| tracking | wall (median) | added | rank 0's end (`close`, median) |\n"
        "|---|---:|---:|---:|\n"
        f"| off | {data['off_median_s']:.2f} s | | {data['off_end_median_s']:.2f} s |\n"
        f"| default (embedded MLflow) | {data['tracked_median_s']:.2f} s | {added:+.1f}% | "
        f"{data['tracked_end_median_s']:.2f} s |\n\n"
        f"The off runs took {min(data['off_wall_s']):.2f} to {max(data['off_wall_s']):.2f} s, "
        f"the tracked ones {min(data['tracked_wall_s']):.2f} to "
        f"{max(data['tracked_wall_s']):.2f} s; tracking added "
        f"{data['tracked_median_s'] - data['off_median_s']:.2f} s to the median; the median of "
        f"the paired ratios (each tracked run against the off run before it) is "
        f"{100 * _paired_median(data):+.1f}%.\n\n"
        + _short_run(data)
        + _per_step(data)
        + bench_notes("tracking")
    )


def _paired_median(data: dict[str, Any]) -> float:
    ratios = [
        float(t) / float(o) - 1
        for o, t in zip(data["off_wall_s"], data["tracked_wall_s"], strict=True)
    ]
    return statistics.median(ratios)


def _per_step(data: dict[str, Any]) -> str:
    """Per-step logging: the tracking process's CPU with and without gathering."""
    if "per_step_logging" not in data:
        return ""
    figures = data["per_step_logging"]
    return (
        f"Per-step logging (3 metrics at each of {figures['steps']} steps, "
        f"{figures['steps_per_s']} steps a second, through rank 0's hand-over to MLflow): the "
        f"tracking process used {figures['cpu_s_one_call_per_step']:.2f} s of CPU with one "
        f"MLflow call per step, {figures['cpu_s_gathered']:.2f} s with the metrics of each "
        f"{figures['gather_s']:g} s gathered into one call (the default).\n\n"
    )


def _short_run(data: dict[str, Any]) -> str:
    """A run shorter than MLflow's start: its end (the figure is newer than some results)."""
    if "short_run_end_median_s" not in data:
        return ""
    return (
        "A short run (1 rank, 10 steps, tracking on, the same existing store): rank 0's end "
        f"(`close`) median {data['short_run_end_median_s']:.2f} s over "
        f"{len(data['short_run_end_s'])} runs.\n\n"
    )


def tracking_busy_section(data: dict[str, Any]) -> str:
    """Tracking's cost to a converted user script whose ranks keep every core busy."""
    off = [run["whole_s_per_iteration"] for run in data["off"]]
    tracked = [run["whole_s_per_iteration"] for run in data["tracked"]]
    return (
        "### Tracking where the ranks use every core\n\n"
        "`python -m bench.tracking_busy`: pytorch/examples' imagenet/main.py as "
        "docs/converting.md converts it (tests/programs/imagenet_shape.py, a small ResNet, "
        f"{data['epochs']} epochs of {data['steps_per_epoch']} steps, top-1 accuracy logged "
        f"every step, interval metrics every {data.get('pairs_print_freq', 4)} steps) on 2 "
        "local ranks of one thread each, so the ranks keep this machine's 2 "
        "cores busy and rank 0's tracking process has none of its own. Tracking off and the "
        f"default (an existing embedded store) alternate, {data['pairs']} pairs. Time per "
        "iteration from the run's interval metrics; CPU time of the processes from /proc.\n\n"
        "| | tracked / off (median of the pairs) |\n"
        "|---|---:|\n"
        f"| time per iteration, whole run | {data['whole_ratio_median']:.3f} |\n"
        f"| time per iteration, after the first epoch | {data['steady_ratio_median']:.3f} |\n"
        "| tracking process's CPU / the ranks' CPU, whole run | "
        f"{100 * data['tracking_cpu_share']:.2f}% |\n"
        "| tracking process's CPU / the ranks' CPU, after the first epoch | "
        f"{100 * data['steady_tracking_cpu_share']:.2f}% |\n{_default_interval_rows(data)}\n"
        f"Single runs' time per iteration ranged from {min(off) * 1000:.1f} to "
        f"{max(off) * 1000:.1f} ms off and {min(tracked) * 1000:.1f} to "
        f"{max(tracked) * 1000:.1f} ms tracked: this machine's run-to-run spread is wider than "
        "tracking's cost, so the CPU share is the figure to read. The tracking process used "
        f"{data['tracking_cpu_s_median']:.2f} s of CPU a run (median), most of it mlflow's "
        "import at the start.\n\n" + bench_notes("tracking_busy")
    )


def _default_interval_rows(data: dict[str, Any]) -> str:
    """The CPU shares of the tracked runs at the default log interval (none in older sets)."""
    if "default_interval" not in data:
        return ""
    runs = len(data["default_interval"])
    return (
        f"| the same, at the default log interval (about 5 s; {runs} tracked runs), whole run | "
        f"{100 * data['default_interval_tracking_cpu_share']:.2f}% |\n"
        "| the same, at the default log interval, after the first epoch | "
        f"{100 * data['default_interval_steady_tracking_cpu_share']:.2f}% |\n"
    )
