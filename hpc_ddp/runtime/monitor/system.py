"""The job's machines as rank 0 records them: each host's CPU and memory, each GPU's
utilisation, memory, power and temperature (``system/<host>/...`` metrics, the names
MLflow's system-metrics view shows), and an alarm for a GPU of the job left idle."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from hpc_ddp.runtime.config import MonitorConfig
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.monitor.nvml import gpu_source
from hpc_ddp.runtime.monitor.usage import USAGE_FIELDS, UsageSampler
from hpc_ddp.runtime.place.dist import gather_object_to_main

#: The metric counting the job's GPUs idle for longer than ``monitor.idle_after_s``.
IDLE_GPUS_METRIC = "system/idle_gpus"
#: The run's tag naming each GPU of the job found idle that long ("node1 GPU 1 (rank 1), ...").
IDLE_GPUS_TAG = "hpc_ddp.idle_gpus"
#: The longest value of that tag: the GPUs beyond are counted, not named (MLflow takes a few
#: thousand characters a tag).
IDLE_GPUS_TAG_CHARS = 1000
#: Metric names per GPU, from the slot's fields.
GPU_METRICS = {
    "gpu_utilization_percent": "utilization_percent",
    "gpu_memory_mib": "memory_mib",
    "gpu_power_w": "power_w",
    "gpu_temperature_c": "temperature_c",
}


class Place(NamedTuple):
    """Where a rank runs: its host (Slurm's node name where there is one) and its GPU's
    name on that host (``"3"``, a MIG slice ``"3-mig1.0"``; None without a GPU)."""

    host: str
    gpu: str | None


def metric_part(host: str) -> str:
    """``host`` as a part of a metric name (MLflow takes letters, digits and _-. /)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", host) or "host"


def system_metrics(rows: Sequence[Sequence[float]], places: Sequence[Place]) -> dict[str, float]:
    """One interval's ``system/`` metrics from every rank's slot (:data:`USAGE_FIELDS`
    order): per host, its ranks' CPU % (100 = one core busy) and memory added up; per GPU,
    its figures (read by its first rank). A value not known is left out."""
    fields = {name: index for index, name in enumerate(USAGE_FIELDS)}
    metrics: dict[str, float] = {}
    read: set[Place] = set()
    for row, place in zip(rows, places, strict=True):
        host = f"system/{metric_part(place.host)}"
        cpu = row[fields["cpu_percent"]]
        metrics[f"{host}/cpu_percent"] = metrics.get(f"{host}/cpu_percent", 0.0) + cpu
        if not math.isnan(row[fields["memory_mib"]]):
            key = f"{host}/memory_mib"
            metrics[key] = metrics.get(key, 0.0) + row[fields["memory_mib"]]
        if place.gpu is None or place in read:
            continue
        read.add(place)
        for field, name in GPU_METRICS.items():
            value = row[fields[field]]
            if not math.isnan(value):
                metrics[f"{host}/gpu{place.gpu}/{name}"] = value
    return metrics


def gpu_text(system: dict[str, float]) -> str:
    """The GPUs' utilisation for the progress line ("" without GPUs): the range over them."""
    busy = [value for name, value in system.items() if name.endswith("/utilization_percent")]
    if not busy:
        return ""
    low, high = min(busy), max(busy)
    return f", GPU {low:.0f}%" if round(low) == round(high) else f", GPU {low:.0f}-{high:.0f}%"


def mig_slice_names(places: Sequence[Place]) -> str:
    """The MIG slices among ``places``, for a line ("node1 GPU 3-mig1.0, ..."; "" for none)."""
    named = dict.fromkeys(f"{p.host} GPU {p.gpu}" for p in places if p.gpu and "-mig" in p.gpu)
    return ", ".join(named)


def gpu_of(name: str) -> str:
    """The GPU a name of the tag gives: "node1 GPU 1" of "node1 GPU 1 (rank 1)"."""
    return name.split(" (rank ")[0]


def idle_gpus_tag(earlier: str, names: Sequence[str]) -> str:
    """The run's ``hpc_ddp.idle_gpus`` tag: the GPUs ``earlier`` (the tag as earlier attempts
    left it) names, then those of ``names`` not among them (whatever rank they name); past
    :data:`IDLE_GPUS_TAG_CHARS`, the rest counted ("... and 40 more", earlier attempts'
    uncounted ones too)."""
    entries = earlier.split(", ")
    uncounted = 0
    if counted := re.fullmatch(r"(.*) and (\d+) more", entries[-1]):
        entries[-1], uncounted = counted[1], int(counted[2])
    entries = [entry for entry in entries if entry]
    # A GPU is its host and number: a later attempt may have given it another rank.
    named = {gpu_of(entry) for entry in entries}
    for name in names:
        if gpu_of(name) not in named:
            named.add(gpu_of(name))
            entries.append(name)
    shown = 0
    while shown < len(entries) and len(", ".join(entries[: shown + 1])) <= IDLE_GPUS_TAG_CHARS - 20:
        shown += 1
    more = uncounted + len(entries) - shown
    return ", ".join(entries[:shown]) + (f" and {more} more" if more else "")


class IdleGpuAlarm:
    """Names, once each, a GPU of the job below ``idle_percent`` for ``idle_after_s``
    without a break, and counts the GPUs idle that long in each interval."""

    def __init__(self, idle_percent: float, idle_after_s: float, earlier: str = "") -> None:
        self.idle_percent, self.idle_after_s = idle_percent, idle_after_s
        #: The run's tag as earlier attempts left it ("" for none): this attempt's GPUs add to it.
        self.earlier = earlier
        #: Each GPU named so far, in the order they were, as "node1 GPU 1 (rank 1)".
        self.said: dict[Place, str] = {}

    @property
    def named(self) -> str:
        """Every GPU named so far in the run (earlier attempts' first), for the run's tag."""
        return idle_gpus_tag(self.earlier, list(self.said.values()))

    def observe(
        self, rows: Sequence[Sequence[float]], places: Sequence[Place]
    ) -> tuple[int, list[str]]:
        """(GPUs idle past the limit, the warning lines not said before)."""
        idle_field = USAGE_FIELDS.index("gpu_idle_s")
        idle: dict[Place, tuple[int, float]] = {}
        for rank, (row, place) in enumerate(zip(rows, places, strict=True)):
            # NaN: not idle (NaN >= x is False).
            if place.gpu is not None and row[idle_field] >= self.idle_after_s:
                idle.setdefault(place, (rank, row[idle_field]))
        lines = []
        for place, (rank, seconds) in idle.items():
            if place not in self.said:
                self.said[place] = f"{place.host} GPU {place.gpu} (rank {rank})"
                lines.append(
                    f"GPU {place.gpu} on {place.host} (rank {rank}) has been below "
                    f"monitor.idle_gpu_percent={self.idle_percent:g}% for {seconds / 60:.0f} "
                    "min: the job holds it and does not use it, and a site that polices idle "
                    "GPUs may end the job. HINT: look at that rank's data wait and its step "
                    "(interval/data_wait_percent, the progress line); a rank with no work of "
                    "its own should not hold a GPU"
                )
        return len(idle), lines


class SystemMonitor:
    """This rank's sampler and, on rank 0, every rank's place and the idle alarm
    (``earlier_idle``: the run's idle-GPU tag as earlier attempts left it)."""

    def __init__(
        self,
        settings: MonitorConfig,
        device: torch.device,
        host: str,
        group: Any,
        main: bool,
        stop: Callable[[], None],
        tag: Callable[[str, str], None],
        earlier_idle: str = "",
    ) -> None:
        source = gpu_source(device)
        self.sampler = UsageSampler(settings.every_s, settings.idle_gpu_percent, source.read)
        self.sampler.start()
        self.places = gather_object_to_main(Place(host, source.gpu_name), group)
        self.alarm = IdleGpuAlarm(settings.idle_gpu_percent, settings.idle_after_s, earlier_idle)
        #: Called once a GPU is idle past the limit, with monitor.idle_stop (None: not asked).
        self.stop = stop if settings.idle_stop else None
        #: Tags the run (its tracker's set_tag) with the GPUs found idle.
        self.tag = tag
        if main and source.read is None:
            get_logger().info(
                f"monitor: each host's CPU and memory are recorded; no GPU metrics ({source.why})"
            )
        if main and (slices := mig_slice_names(self.places)):
            get_logger().info(
                f"monitor: MIG slices {slices}: NVML gives a slice no utilisation, so their "
                "memory and their GPU's temperature are recorded, and the idle-GPU alarm "
                "cannot watch them"
            )

    def metrics(self, rows: Sequence[Sequence[float]]) -> dict[str, float]:
        """Rank 0: the interval's ``system/`` metrics; a GPU idle past the limit is warned of
        once, named in the run's ``hpc_ddp.idle_gpus`` tag and counted in
        ``system/idle_gpus``."""
        metrics = system_metrics(rows, self.places)
        if any(place.gpu is not None for place in self.places):
            idle, lines = self.alarm.observe(rows, self.places)
            metrics[IDLE_GPUS_METRIC] = float(idle)
            for line in lines:
                get_logger().warning(line)
            if lines:
                self.tag(IDLE_GPUS_TAG, self.alarm.named)
            if lines and self.stop is not None:
                get_logger().warning(
                    "monitor.idle_stop=true: stopping the run with a checkpoint at the ranks' "
                    "next agreed check, without a requeue"
                )
                self.stop()
                self.stop = None
        return metrics

    def close(self) -> None:
        """Stop this rank's sampler."""
        self.sampler.close()
