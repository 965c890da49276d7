"""The machines' panel of `hpc-ddp plot`: each GPU's utilisation over the run, or where the
run had no GPU, each host's CPU use, from the ``system/`` metrics rank 0 recorded."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.tracking.record import read_metrics
from hpc_ddp.view.attempt_marks import with_headroom

Series = dict[str, tuple[list[float], list[float]]]

GPU_BUSY = re.compile(r"^system/(?P<host>[^/]+)/gpu(?P<gpu>[^/]+)/utilization_percent$")
CPU_BUSY = re.compile(r"^system/(?P<host>[^/]+)/cpu_percent$")


def usage_series(run_dir: Path) -> tuple[str, Series]:
    """(the panel's title, label -> (steps, values)): every GPU's utilisation ("node1 GPU
    0"), or without GPU metrics every host's CPU ("node1"); ("", {}) with neither."""
    gpus: Series = {}
    cpus: Series = {}
    for entry in read_metrics(run_dir):
        for name, value in entry["metrics"].items():
            if value is None:
                continue
            if found := GPU_BUSY.match(name):
                label, into = f"{found['host']} GPU {found['gpu']}", gpus
            elif found := CPU_BUSY.match(name):
                label, into = found["host"], cpus
            else:
                continue
            steps, values = into.setdefault(label, ([], []))
            steps.append(float(entry["step"]))
            values.append(float(value))
    if gpus:
        return "GPU utilisation (%)", dict(sorted(gpus.items()))
    if cpus:
        return "CPU of each host (%, 100 = one core)", dict(sorted(cpus.items()))
    return "", {}


def broken_at(
    steps: list[float], values: list[float], breaks: Sequence[int]
) -> tuple[list[float], list[float]]:
    """The readings with a gap (NaN) at each step where another attempt took over: the
    machines between two attempts were not the job's, so no line joins them."""
    points = sorted([*zip(steps, values, strict=True), *((float(at), math.nan) for at in breaks)])
    return [step for step, _ in points], [value for _, value in points]


def draw_usage(axes: Any, title: str, series: Series, breaks: Sequence[int] = ()) -> None:
    """The machines' panel on ``axes``: a line per GPU or host, broken at ``breaks`` (the
    steps later attempts resumed from)."""
    for label, (steps, values) in series.items():
        dots = 3 if len(steps) > 2 else 8  # a reading or two must still be seen
        axes.plot(*broken_at(steps, values, breaks), ".-", markersize=dots, linewidth=1,
                  label=label)  # fmt: skip
    readings = (value for _, values in series.values() for value in values)
    axes.set_ylim(0, with_headroom(max(filter(math.isfinite, readings), default=0.0)))
    axes.set_title(title)
    axes.set_xlabel("step")
    axes.grid(alpha=0.3)
    if len(series) <= 16:  # a legend of every GPU of a large job would hide the lines
        axes.legend(fontsize="small")
