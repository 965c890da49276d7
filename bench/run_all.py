"""`make bench`: every benchmark of bench/catalogue.py (or those named: ``python -m
bench.run_all overhead_paired startup``), then bench/README.md's sections from their results.

A benchmark that needs the test Slurm cluster (`make cluster-up NODES=16`) runs when it
answers, one that needs a GPU where one is visible; either runs when named."""

from __future__ import annotations

import importlib
import sys

from bench import report
from bench.catalogue import BENCHMARKS, Benchmark


def available(benchmark: Benchmark) -> bool:
    if benchmark.needs == "cluster":
        from bench.scale import cluster_answers

        return cluster_answers()
    if benchmark.needs == "gpu":
        from bench.gpu import gpu_facts

        return gpu_facts() is not None
    return True


def main(names: list[str]) -> int:
    known = {benchmark.name for benchmark in BENCHMARKS}
    unknown = sorted(set(names) - known)
    if unknown:
        print(
            f"bench.run_all: no benchmark named {', '.join(unknown)}\n"
            f"HINT: one of {', '.join(sorted(known))}",
            file=sys.stderr,
        )
        return 2
    for benchmark in BENCHMARKS:
        if benchmark.name in names or (not names and available(benchmark)):
            importlib.import_module(benchmark.module).run()
    report.write_readme()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
