"""Writes bench/README.md from bench/results/*.json, one section per benchmark of
bench/catalogue.py in its order."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.catalogue import BENCHMARKS
from bench.harness import REPO, RESULTS
from bench.report_scale import plot

HEADER = """# Benchmarks

`make bench` runs them all and rewrites this file from `bench/results/*.json`
(`python -m bench.run_all overhead_paired` runs one). These are reported figures, not timed
tests. The CPU figures are gloo on CPU ranks, on {machine}; the GPU sections name their GPU.

"""


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def write_readme() -> Path:
    sections = []
    machine = "unknown"
    for benchmark in BENCHMARKS:
        data = load(benchmark.name)
        if data is None:
            sections.append(benchmark.absent)
            continue
        if benchmark.needs != "gpu":
            facts = data["machine"]
            machine = f"{facts['cpus']} CPUs, {facts['machine']}, Python {facts['python']}"
        sections.append(benchmark.section(data))
        if benchmark.name == "scale":
            plot(data)
    path = REPO / "bench" / "README.md"
    path.write_text(HEADER.format(machine=machine) + "".join(sections))
    return path


if __name__ == "__main__":
    write_readme()
