"""What each rank's reading of its machine costs (monitor.every_s): one reading on the
sampler's thread (its processes' memory from /proc and, on a GPU, NVML) and one take where a
log interval ends (its processes' CPU time), in a process that imported torch and has
DataLoader-like children, as a rank has; and the CPU time that makes per hour and per node.

    python -m bench.usage_cost && python -m bench.report   # bench/results/usage_cost.json

(Its section of bench/README.md: bench/report_io.py's usage_section.)
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from typing import Any

import torch

from bench.harness import write_result
from hpc_ddp.runtime.monitor.nvml import gpu_source
from hpc_ddp.runtime.monitor.usage import UsageSampler

#: Children per rank (DataLoader workers), and readings timed.
WORKERS, READINGS = 4, 300
#: Ranks per node the per-node figure is given for (a node of 8 GPUs).
RANKS_PER_NODE = 8


def _idle_worker(stop: Any) -> None:
    stop.wait()


def timed(call: Any, repeats: int) -> float:
    """The median seconds of ``call()``."""
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def run() -> dict[str, Any]:
    context = multiprocessing.get_context("fork")
    stop = context.Event()
    workers = [context.Process(target=_idle_worker, args=(stop,)) for _ in range(WORKERS)]
    for worker in workers:
        worker.start()
    held = torch.randn(4096, 4096)  # a rank's memory: 64 MiB of tensors besides torch
    try:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        source = gpu_source(device)
        # cpu_every_s=0: each take reads the CPU time, as one a second apart does.
        sampler = UsageSampler(10.0, 5.0, source.read, cpu_every_s=0.0)
        sample_s = timed(sampler.sample, READINGS)
        take_s = timed(sampler.take, READINGS)
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    del held
    every_s = 10.0
    per_hour_s = 3600 / every_s * sample_s
    result = {
        "workers": WORKERS,
        "readings": READINGS,
        "gpu": torch.cuda.get_device_name(0) if source.read else None,
        "sample_ms": round(sample_s * 1e3, 3),
        "take_ms": round(take_s * 1e3, 3),
        "every_s": every_s,
        "cpu_s_per_hour_per_rank": round(per_hour_s, 3),
        "ranks_per_node": RANKS_PER_NODE,
        "cpu_s_per_hour_per_node": round(per_hour_s * RANKS_PER_NODE, 3),
    }
    path = write_result("usage_cost", result)
    print(
        f"a reading {result['sample_ms']} ms, a take {result['take_ms']} ms; at every_s=10: "
        f"{result['cpu_s_per_hour_per_node']} CPU s per hour on a node of {RANKS_PER_NODE} "
        f"ranks ({path})"
    )
    return result


if __name__ == "__main__":
    run()
