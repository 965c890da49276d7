"""`make bench`: every benchmark, then bench/README.md's tables from bench/results/*.json."""

from __future__ import annotations

import sys

from bench import checkpoint_io, data_memory, gpu, interleaved, lm, overhead, report, startup


def main() -> None:
    only = set(sys.argv[1:])
    for name, module in (
        ("checkpoint_io", checkpoint_io),
        ("data_memory", data_memory),
        ("startup", startup),
        ("overhead", overhead),
        ("overhead_paired", interleaved),
        ("lm_paired", lm),
    ):
        if not only or name in only:
            module.run()
    # The GPU figures need a GPU: taken where one is visible, or when asked for by name.
    if "gpu" in only or (not only and gpu.gpu_facts() is not None):
        gpu.run()
    report.write_readme()


if __name__ == "__main__":
    main()
