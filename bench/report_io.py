"""bench/README.md's sections on files: checkpoint save and load against size, and the
Parquet loader's memory and bytes read."""

from __future__ import annotations

from typing import Any


def checkpoint_section(data: dict[str, Any]) -> str:
    lines = [
        "## 3. Checkpoint save and load vs size",
        "",
        "Save = torch.save to a temporary file, fsync, rename, fsync the directory, prune; "
        "load = torch.load(weights_only=True, mmap=True), which maps the file: its tensors are "
        "read from storage when first used. Model + SGD momentum state.",
        "",
        "| parameters | size MB | save s | load s |",
        "|---:|---:|---:|---:|",
    ]
    for row in data["rows"]:
        lines.append(
            f"| {row['parameters']:,} | {row['size_mb']:.1f} | {row['save_s']:.3f} | {row['load_s']:.3f} |"
        )
    shared = data.get("shared_read")
    if shared:
        each = " + ".join(f"{mb:.0f}" for mb in shared["read_mb"])
        lines += [
            "",
            f"**One node's ranks resuming from one file.** {shared['readers']} processes load the "
            f"same {shared['size_mb']:.0f} MB checkpoint at once, after its pages were dropped "
            f"from the page cache: together they read {shared['storage_reads_per_file']:.2f} "
            f"times its size from storage ({each} MB, read_bytes in /proc/self/io; each uses "
            "every tensor). The page "
            "cache serves every rank of a node after the first read, so a resume reads the file "
            "once per node, not once per rank.",
        ]
    return "\n".join(lines) + "\n\n"


def data_memory_section(data: dict[str, Any]) -> str:
    lines = [
        "## 4. Parquet data: per-rank memory and bytes read (one epoch)",
        "",
        f"{data['rows']:,} rows x {data['features']} float32 features in row groups of "
        f"{data['row_group_size']:,}, 4 files. Data memory = a rank's peak RSS minus its RSS "
        "after imports; bytes read from the files (rchar). The baseline loads the whole set on "
        "every rank, as typical scripts do. Target: sharded memory falls as 1/W plus a constant.",
        "",
        "| W | sharded: data MB per rank | sharded: read MB per rank | load-everything: data MB | load-everything: read MB |",
        "|---:|---:|---:|---:|---:|",
    ]
    for world in (1, 2, 4):
        sharded, everything = data[f"sharded_w{world}"], data[f"load_everything_w{world}"]
        lines.append(
            f"| {world} | {sharded['max_data_rss_mb']:.0f} | {sharded['max_bytes_read_mb']:.0f} | "
            f"{everything['max_data_rss_mb']:.0f} | {everything['max_bytes_read_mb']:.0f} |"
        )
    lines += [
        "",
        "Bytes read fall as 1/W (plus the at most two row groups a rank shares with a "
        "neighbour). Memory does better than 1/W: a rank streams one row group at a time, so "
        "its data memory is a constant (one group, pyarrow's pool and the loader) that does "
        "not grow with the set, against the whole set on every rank for the baseline.",
    ]
    return "\n".join(lines) + "\n\n"


def checks_section(data: dict[str, Any]) -> str:
    if not data["cpu"]:
        return ""
    lines = [
        "## 8. Checks before the first step: their cost at start",
        "",
        "`bench/checks_cost.py`: the built-in trainer, one step, `checks.command=true`, on W "
        "local CPU ranks; the start's time from the process groups to the checks' end "
        "(rank 0's timeline) and each check on the slowest rank (checks.json), medians of "
        f"{data['cpu'][0]['repeats']} runs. Target: under 5 s on a healthy job.",
        "",
        "| ranks | checks at start | devices | storage | checks.command | collective |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in data["cpu"]:
        collective = f"{row['collective']:.3f} s" if "collective" in row else "-"
        lines.append(
            f"| {row['world_size']} | {row['start_s']:.3f} s | {row['devices']:.3f} s | "
            f"{row['storage']:.3f} s | {row['command']:.3f} s | {collective} |"
        )
    gpu = data.get("gpu")
    lines += [
        "",
        "Each rank checks its own devices and each node its run directory and command, all at "
        "once, so these stay flat with the ranks; what grows is the gather of every rank's "
        "results (a few hundred bytes each over gloo: about 150 KB at 512 ranks) and the "
        "collective check's all-gather of one value per rank, both well under a second at 512 "
        "ranks by the scale figures of section 5 (projected, not measured). "
        + (
            f"On a GPU ({gpu['gpu']}, torch {gpu['torch']}), cuda:0's checks (free memory, "
            "2048x2048 products in float32 and bfloat16, a seeded product against float64) "
            f"took {gpu['first_s']:.2f} s at the first call (CUDA's kernels loaded) and "
            f"{gpu['next_s']:.2f} s after."
            if gpu
            else "The GPU's device checks have no figure yet (`python -m bench.checks_cost gpu`)."
        ),
        "",
    ]
    return "\n".join(lines) + "\n"


def requeue_section(data: dict[str, Any]) -> str:
    seconds, median = data["seconds"], data["median_s"]
    return (
        "## 9. A failed node to the next attempt, against a plain requeue\n\n"
        "`python -m bench.requeue_cost` on the test Slurm cluster (3 nodes; a job of 2 nodes, "
        "one task each, the built-in trainer): seconds from a node failing the checks "
        "(recorded in excluded_hosts.json) to the next attempt's first finished step, on the "
        "other two nodes; and from a plain requeue's stop (`preempt.stop_at_step`, its "
        "checkpoint on disk) to the resumed attempt's first finished step. "
        f"Medians of {data['repeats']} runs.\n\n"
        "| path | median s | each run s |\n|---|---:|---|\n"
        f"| node failure: requeued held, ExcNodeList updated, released | "
        f"{median['node_failure']:.1f} | {', '.join(map(str, seconds['node_failure']))} |\n"
        f"| plain `scontrol requeue` | {median['plain_requeue']:.1f} | "
        f"{', '.join(map(str, seconds['plain_requeue']))} |\n\n"
        "Both are mostly Slurm's own wait before a requeued job may start again (about 10 s on "
        "the test cluster, whose credentials expire after 10 s; about 150 s with Slurm's defaults "
        "there) and the attempt's start-up; leaving a node out adds three `scontrol` "
        "calls.\n\n"
    )


def usage_section(data: dict[str, Any]) -> str:
    where = f"on {data['gpu']} (NVML included)" if data["gpu"] else "on CPU (no NVML reading)"
    return (
        "## 10. Reading the machine: the monitor's cost per rank\n\n"
        "`bench/usage_cost.py`: one rank's sampler in a process that imported torch and holds "
        f"{data['workers']} DataLoader-like children, {where}; medians of "
        f"{data['readings']} calls.\n\n"
        "| a reading (thread, every `monitor.every_s`) | a take that reads the CPU time | CPU "
        f"per hour per rank | per node of {data['ranks_per_node']} ranks |\n"
        "|---:|---:|---:|---:|\n"
        f"| {data['sample_ms']:.3f} ms | {data['take_ms']:.3f} ms | "
        f"{data['cpu_s_per_hour_per_rank']:.2f} s | {data['cpu_s_per_hour_per_node']:.2f} s |\n\n"
        "A reading runs on the sampler's own thread (the memory of each process from its "
        "`smaps_rollup`, the GPU through NVML); a take, on the training thread at a log "
        "interval, reads each process's CPU time, at most once a second (a take in between "
        "gives the share last read). Both grow with the processes a rank holds, not with the "
        "ranks of the job.\n\n"
    )


def step_timers_section(data: dict[str, Any]) -> str:
    optimizer, forward = data["optimizer_step"], data["timed_forward"]
    sync = data.get("gradient_sync")
    return (
        "### Timing the step's parts\n\n"
        f"`python -m bench.step_timers`: one process, one thread, {data['rounds']} rounds of "
        f"{data['calls']:,} calls alternating with and without the timer; the cost is the "
        "median over rounds of the difference.\n\n"
        "| timed call | untimed | timed | cost a call |\n"
        "|---|---:|---:|---:|\n"
        f"| an SGD step of a 2-layer MLP (torch's global optimizer step hooks) | "
        f"{optimizer['without_us']:.2f} µs | {optimizer['with_us']:.2f} µs | "
        f"{optimizer['cost_us']:.2f} µs |\n"
        f"| a `Linear(64, 64)` forward on 8 samples (the forward timer; under FSDP each "
        f"sharded block has one) | {forward['without_us']:.2f} µs | {forward['with_us']:.2f} "
        f"µs | {forward['cost_us']:.2f} µs |\n"
        + (
            f"| a forward and backward of the MLP under DDP (monitor.time_gradient_sync's "
            f"timer; one rank over loopback gloo) | {sync['without_us']:.2f} µs | "
            f"{sync['with_us']:.2f} µs | {sync['cost_us']:.2f} µs |\n"
            if sync
            else ""
        )
        + "\n"
        "The optimizer hooks are torch's own and process-wide: in the paired benchmark (§1) "
        "the hand-written side's steps pass through them too, so this row is their cost, not "
        "§1's. On a GPU each timed call records two CUDA events instead of reading the clock, "
        "and the events are read once done, at the log interval. The gradient-sync timer (on by default) is "
        "a Python call and two autograd callbacks a backward, whatever the buckets (a few µs "
        "either way is below what this bench resolves on a backward of 180 µs); a "
        "communication hook that reduced in DDP's place, the timer before it, cost 55 to 79 µs "
        "a bucket here.\n\n"
    )


def record_writes_section(data: dict[str, Any]) -> str:
    background, in_line = data["background"], data["in_line"]
    return (
        "### Rank 0's record at each log interval\n\n"
        f"`python -m bench.record_writes`: one process, {data['calls']:,} intervals of "
        f"{data['metrics']} metrics logged through rank 0's journal (metrics.jsonl, "
        "status.json) into a run directory in the home folder, each call timed as the "
        "training thread sees it.\n\n"
        "| files written | median | 99th percentile |\n"
        "|---|---:|---:|\n"
        f"| by the record's background thread (as runs do) | {background['median_us']:.0f} µs "
        f"| {background['p99_us']:.0f} µs |\n"
        f"| in line (the thread waits for them) | {in_line['median_us']:.0f} µs "
        f"| {in_line['p99_us']:.0f} µs |\n\n"
        "Every rank waits for rank 0's time here at the next collective. On a local disk the "
        "files cost a few hundred microseconds; on a shared file system (NFS, Lustre), where "
        "creating and renaming a file waits for the metadata server, the in-line figure "
        "grows with that server's latency, and the background one does not.\n\n"
    )
