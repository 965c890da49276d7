"""Every benchmark once, in the order bench/README.md shows them: what `make bench`
(``python -m bench.run_all``) runs and what ``python -m bench.report`` renders from each one's
results file. A new benchmark is a module with ``run()`` (which writes
``bench/results/<name>.json``) and a section function, added here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from bench.report_gpu import GPU_NOTE, deterministic_section, gpu_section, gpu_sharded_section
from bench.report_io import (
    checkpoint_section,
    checks_section,
    data_memory_section,
    record_writes_section,
    requeue_section,
    step_timers_section,
    usage_section,
)
from bench.report_scale import scale_section, tracking_busy_section, tracking_section
from bench.report_sharded import checksum_section, sharded_section
from bench.report_steps import (
    iterations_section,
    lm_section,
    overhead_paired_section,
    startup_section,
)
from bench.report_sweep import sweep_section


@dataclass(frozen=True)
class Benchmark:
    #: Its results file, ``bench/results/<name>.json``, and its name for ``bench.run_all``.
    name: str
    #: The module whose ``run()`` takes the figures.
    module: str
    #: Its section of bench/README.md, from its results.
    section: Callable[[dict[str, Any]], str]
    #: What it needs beyond this machine's CPUs: the test Slurm cluster or a GPU.
    needs: Literal["", "cluster", "gpu"] = ""
    #: What the README says while it has no results ("": nothing).
    absent: str = ""


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("overhead_paired", "bench.interleaved", overhead_paired_section),
    Benchmark("lm_paired", "bench.lm", lm_section),
    Benchmark("iterations_paired", "bench.iterations", iterations_section),
    Benchmark("startup", "bench.startup", startup_section),
    Benchmark("checkpoint_io", "bench.checkpoint_io", checkpoint_section),
    Benchmark("sharded", "bench.sharded", sharded_section),
    Benchmark("checksum_cost", "bench.checksum_cost", checksum_section),
    Benchmark("data_memory", "bench.data_memory", data_memory_section),
    Benchmark("scale", "bench.scale", scale_section, needs="cluster"),
    Benchmark("tracking_cost", "bench.tracking_cost", tracking_section),
    Benchmark("tracking_busy", "bench.tracking_busy", tracking_busy_section),
    Benchmark("record_writes", "bench.record_writes", record_writes_section),
    Benchmark("sweep_scale", "bench.sweep_scale", sweep_section),
    Benchmark("checks_cost", "bench.checks_cost", checks_section),
    Benchmark("requeue_cost", "bench.requeue_cost", requeue_section, needs="cluster"),
    Benchmark("usage_cost", "bench.usage_cost", usage_section),
    Benchmark("step_timers", "bench.step_timers", step_timers_section),
    Benchmark("gpu", "bench.gpu", gpu_section, needs="gpu", absent=GPU_NOTE),
    Benchmark("gpu_sharded", "bench.gpu_sharded", gpu_sharded_section, needs="gpu"),
    Benchmark("deterministic_cost", "bench.deterministic_cost", deterministic_section, needs="gpu"),
)
