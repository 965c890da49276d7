"""`make bench`: every benchmark, then bench/README.md's tables from bench/results/*.json."""

from __future__ import annotations

import sys

from bench import (
    checkpoint_io,
    checksum_cost,
    data_memory,
    gpu,
    interleaved,
    iterations,
    lm,
    overhead,
    report,
    scale,
    sharded,
    startup,
    sweep_scale,
    tracking_cost,
)


def main() -> None:
    only = set(sys.argv[1:])
    for name, module in (
        ("checkpoint_io", checkpoint_io),
        ("sharded", sharded),
        ("checksum_cost", checksum_cost),
        ("data_memory", data_memory),
        ("startup", startup),
        ("overhead", overhead),
        ("overhead_paired", interleaved),
        ("lm_paired", lm),
        ("iterations_paired", iterations),
        ("tracking_cost", tracking_cost),
        ("sweep_scale", sweep_scale),
    ):
        if not only or name in only:
            module.run()
    # The scale figures need the test Slurm cluster (`make cluster-up NODES=16`).
    if "scale" in only or (not only and scale.cluster_answers()):
        scale.run()
    # The GPU figures need a GPU: taken where one is visible, or when asked for by name.
    if "gpu" in only or (not only and gpu.gpu_facts() is not None):
        gpu.run()
    report.write_readme()


if __name__ == "__main__":
    main()
