"""bench/README.md's section on a sweep's record at scale (bench/sweep_scale.py)."""

from __future__ import annotations

from typing import Any


def sweep_section(data: dict[str, Any]) -> str:
    rows = "".join(
        f"| {row['tasks']:,} | {row['arrays']} | {row['submit_s']:.2f} s | "
        f"{row['task_start_and_end_median_s'] * 1000:.1f} ms | {row['record_read_s']:.2f} s | "
        f"{row['sweep_json_bytes'] / 1e6:.1f} MB |\n"
        for row in data["sizes"]
    )
    return (
        "## 7. A sweep's record at scale\n\n"
        "`python -m bench.sweep_scale`: `hpc_ddp.sweep.submit_sweep` of a one-key grid "
        "against a stand-in sbatch and scontrol that answer at once (MaxArraySize 1001, "
        "Slurm's default), so the figures are hpc_ddp's own cost; then every task's start "
        "and end recorded as a task's processes record them (the median over 200 of them, "
        "each reading sweep.json and its own state), and the whole record read once, as "
        "`sweep status` reads it.\n\n"
        "| tasks | arrays | submit | a task's start + end | whole record read | "
        "sweep.json |\n|---:|---:|---:|---:|---:|---:|\n"
        f"{rows}\n"
        "sweep.json is written once at submit; arrays are appended to `arrays.jsonl` and "
        "each task changes only its own state file, so submitting grows linearly with the "
        "tasks. Before, every array and every task's start and end rewrote the whole "
        "sweep.json under the lock: a 100,000-task grid had submitted 64 of its 100 arrays "
        "after 5 minutes. What still grows with the sweep is each task reading sweep.json "
        "(its definition) at its start and end.\n\n"
    )
