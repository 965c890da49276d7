"""Benchmark 6b: what tracking costs a converted user script whose ranks use every core.

pytorch/examples' imagenet/main.py as docs/converting.md converts it
(tests/programs/imagenet_shape.py: a small ResNet, SGD with momentum, top-1 accuracy logged
every step) on 2 local ranks of one thread each, so the ranks keep this machine's 2 cores
busy and rank 0's tracking process has no core of its own. Tracking off and the default
(an existing embedded store) alternate. The figure is the time per iteration as the script's
own progress meter would show it, from the run's interval metrics: over the whole run (the
tracking process's start, mlflow's import, falls in its first seconds), and in the steady
state after the first epoch. Single runs here vary by more than tracking's cost, so the CPU
time is read as well (from /proc, every 0.2 s): the tracking process's against the ranks',
over the whole run and after the first epoch. Where the ranks keep every core busy, that
share is what tracking can take from training at most. The pairs log every 4 steps (several
intervals a second); a few more tracked runs at the default log interval (about 5 s, as a
script that does not set one gets) show the steady share most scripts pay.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import REPO, base_environ, median, write_result

PROGRAM = REPO / "tests" / "programs" / "imagenet_shape.py"
EPOCHS, IMAGES, BATCH = 4, 6400, 64
STEPS_PER_EPOCH = IMAGES // BATCH
#: Steps per log interval in the pairs (0: the default, about 5 s).
PAIRS_PRINT_FREQ = 4


def iteration_seconds(run_dir: Path) -> tuple[float, float]:
    """(seconds per iteration over every logged interval, over those after the first
    epoch), from the intervals' samples/s."""
    whole: list[tuple[float, int]] = []
    last_step = 0
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        entry = json.loads(line)
        rate = entry.get("metrics", {}).get("interval/samples_per_s")
        if rate is None:
            continue
        steps = entry["step"] - last_step
        last_step = entry["step"]
        whole.append((steps * BATCH / rate, entry["step"]))
    steady = [(seconds, step) for seconds, step in whole if step > STEPS_PER_EPOCH]
    return (
        sum(s for s, _ in whole) / last_step,
        sum(s for s, _ in steady) / (last_step - STEPS_PER_EPOCH),
    )


def processes_cpu_s(marks: dict[str, str]) -> dict[str, float]:
    """CPU seconds of this machine's processes whose command line holds each mark, by mark."""
    found = dict.fromkeys(marks, 0.0)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        for name, mark in marks.items():
            if mark in command:
                found[name] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return found


def cpu_at(samples: list[tuple[float, dict[str, float]]], unix: float) -> dict[str, float]:
    """The CPU seconds read last at or before ``unix``."""
    return [cpu for at, cpu in samples if at <= unix][-1]


def one_run(
    output_dir: Path, tracking: bool, print_freq: int = PAIRS_PRINT_FREQ
) -> dict[str, float]:
    arguments = [
        sys.executable, "-m", "hpc_ddp", "local", "--nproc", "2", str(PROGRAM),
        "--epochs", str(EPOCHS), "--train-images", str(IMAGES), "-b", str(BATCH),
        "--print-freq", str(print_freq), f"run.output_dir={output_dir}",
        "checkpoint.enabled=false",
    ]  # fmt: skip
    if not tracking:
        arguments.append("tracking.enabled=false")
    environ = {**base_environ(), "OMP_NUM_THREADS": "1"}
    marks = {"ranks": str(PROGRAM), "tracking": "hpc_ddp.runtime.tracking.worker"}
    samples: list[tuple[float, dict[str, float]]] = []
    with subprocess.Popen(arguments, cwd=REPO, env=environ, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True) as launched:  # fmt: skip
        while launched.poll() is None:
            samples.append((time.time(), processes_cpu_s(marks)))
            time.sleep(0.2)
        errors = launched.stderr.read() if launched.stderr else ""
    if launched.returncode != 0:
        raise RuntimeError(f"the run failed ({launched.returncode}): {errors[-2000:]}")
    [run_dir] = [path.parent for path in output_dir.rglob("metrics.jsonl")]
    summary = json.loads((run_dir / "summary.json").read_text())
    if summary["tracking"] != ("ok" if tracking else "off"):
        raise RuntimeError(f"tracking was {summary['tracking']!r} in {run_dir}")
    whole, steady = iteration_seconds(run_dir)
    epoch_end, last = interval_times(run_dir)
    # The ranks' CPU includes "hpc-ddp local" itself, which sleeps.
    first, after_epoch, end = samples[0][1], cpu_at(samples, epoch_end), cpu_at(samples, last)
    shutil.rmtree(run_dir)
    figures = {"whole_s_per_iteration": whole, "steady_s_per_iteration": steady}
    if tracking:
        figures |= {
            "tracking_cpu_s": end["tracking"] - first["tracking"],
            "ranks_cpu_s": end["ranks"] - first["ranks"],
            "steady_tracking_cpu_s": end["tracking"] - after_epoch["tracking"],
            "steady_ranks_cpu_s": end["ranks"] - after_epoch["ranks"],
        }
    return figures


def interval_times(run_dir: Path) -> tuple[float, float]:
    """When the first epoch's last interval and the run's last interval were logged (Unix)."""
    times = [
        (entry["step"], entry["time"])
        for entry in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "interval/samples_per_s" in entry.get("metrics", {})
    ]
    return max(t for step, t in times if step <= STEPS_PER_EPOCH), times[-1][1]


def run(pairs: int = 8, default_interval_runs: int = 4) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="hpc-ddp-tracking-busy-"))
    one_run(root / "tracked", True)  # the store exists from here on, as after a first run
    off: list[dict[str, float]] = []
    tracked: list[dict[str, float]] = []
    for _ in range(pairs):
        off.append(one_run(root / "off", False))
        tracked.append(one_run(root / "tracked", True))
    by_default = [one_run(root / "tracked", True, 0) for _ in range(default_interval_runs)]
    shutil.rmtree(root, ignore_errors=True)

    def ratios(key: str) -> list[float]:
        return [t[key] / o[key] for o, t in zip(off, tracked, strict=True)]

    def share(part: str, whole: str, runs: list[dict[str, float]] = tracked) -> float:
        return median([t[part] / t[whole] for t in runs])

    result: dict[str, Any] = {
        "pairs": pairs,
        "epochs": EPOCHS,
        "steps_per_epoch": STEPS_PER_EPOCH,
        "off": off,
        "tracked": tracked,
        "whole_ratio_median": median(ratios("whole_s_per_iteration")),
        "steady_ratio_median": median(ratios("steady_s_per_iteration")),
        "whole_ratios": ratios("whole_s_per_iteration"),
        "steady_ratios": ratios("steady_s_per_iteration"),
        "tracking_cpu_share": share("tracking_cpu_s", "ranks_cpu_s"),
        "steady_tracking_cpu_share": share("steady_tracking_cpu_s", "steady_ranks_cpu_s"),
        "tracking_cpu_s_median": median([t["tracking_cpu_s"] for t in tracked]),
        "pairs_print_freq": PAIRS_PRINT_FREQ,
        "default_interval": by_default,
        "default_interval_tracking_cpu_share": share("tracking_cpu_s", "ranks_cpu_s", by_default),
        "default_interval_steady_tracking_cpu_share": share(
            "steady_tracking_cpu_s", "steady_ranks_cpu_s", by_default
        ),
    }
    print(
        f"tracking on a busy machine ({pairs} pairs): time per iteration tracked/off, whole "
        f"run {result['whole_ratio_median']:.3f}, after the first epoch "
        f"{result['steady_ratio_median']:.3f}; the tracking process's CPU against the ranks' "
        f"{100 * result['tracking_cpu_share']:.2f}% (after the first epoch "
        f"{100 * result['steady_tracking_cpu_share']:.2f}%); at the default log interval "
        f"{100 * result['default_interval_tracking_cpu_share']:.2f}% (after the first epoch "
        f"{100 * result['default_interval_steady_tracking_cpu_share']:.2f}%)",
        flush=True,
    )
    write_result("tracking_busy", result)
    return result


if __name__ == "__main__":
    run()
