"""What each rank's share of the machine is doing: its GPU's utilisation, memory, power and
temperature, and the CPU time and memory of its processes (the rank and its DataLoader
workers).

A thread of the rank's own reads the GPU and the memory every ``monitor.every_s`` (NVML's
utilisation is a share of its last second or so, so it is sampled through the interval, off
the training thread); the CPU time where a log interval ends, at most once a second. Each rank
reads only the GPU it trains on: a node's GPUs that belong to another job are never read.
The interval's figures travel to rank 0 with the interval's metrics, a slot per rank (see
:mod:`hpc_ddp.runtime.loop.intervals`).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

#: One rank's figures for one log interval, in its slot's order. NaN: not known (no GPU).
USAGE_FIELDS = (
    # CPU time of the rank's processes over the time since it was last read (at most once a
    # second, so the last second at least where intervals are shorter).
    "cpu_percent",
    "memory_mib",  # their memory (proportional set size), the most seen
    "gpu_utilization_percent",  # the mean of the interval's samples
    "gpu_memory_mib",  # the most used
    "gpu_power_w",  # the mean
    "gpu_temperature_c",  # the highest
    # How long the GPU has been below monitor.idle_gpu_percent without a break (NaN: it is not).
    "gpu_idle_s",
)


@dataclass(frozen=True)
class GpuReading:
    """One NVML reading of a GPU; NaN where the driver does not say."""

    utilization_percent: float
    memory_mib: float
    power_w: float = math.nan
    temperature_c: float = math.nan


def process_cpu_s(pid: int | None = None, proc: Path = Path("/proc")) -> float:
    """CPU seconds used so far by ``pid`` (this process) and every process below it, from
    Linux's ``/proc`` (this process alone, from ``os.times``, where there is none)."""
    pid = os.getpid() if pid is None else pid
    ticks, found = 0, False
    for member in process_tree(pid, proc):
        try:
            stat = (proc / str(member) / "stat").read_text()
        except OSError:  # it ended between the listing and the reading
            continue
        # After the command's closing parenthesis: state is field 3; utime, stime, cutime and
        # cstime are fields 14 to 17 (the children's parts count those already waited for).
        ticks += sum(int(value) for value in stat.rsplit(")", 1)[1].split()[11:15])
        found = True
    if not found:
        times = os.times()
        return times.user + times.system
    return ticks / os.sysconf("SC_CLK_TCK")


def process_memory_mib(pid: int | None = None, proc: Path = Path("/proc")) -> float:
    """Memory of ``pid`` and every process below it: the sum of their proportional set sizes
    (a page shared by n of them counts 1/n in each, so a DataLoader worker's copy-on-write
    pages are not counted twice); their resident sizes where the kernel gives no PSS, NaN
    where there is no ``/proc``."""
    pid = os.getpid() if pid is None else pid
    kib, found = 0, False
    for member in process_tree(pid, proc):
        try:
            kib += proportional_kib((proc / str(member) / "smaps_rollup").read_text())
        except (OSError, ValueError):
            try:
                pages = int((proc / str(member) / "statm").read_text().split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kib += pages * os.sysconf("SC_PAGE_SIZE") // 1024
        found = True
    return kib / 1024 if found else math.nan


def proportional_kib(rollup: str) -> int:
    """The ``Pss:`` line of a ``smaps_rollup`` text, in KiB (ValueError without one)."""
    for line in rollup.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    raise ValueError("no Pss line")


def process_tree(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """``pid`` and its descendants, from each thread's ``children`` list ([pid] alone where
    the kernel keeps no such list)."""
    tree, index = [pid], 0
    while index < len(tree):
        try:
            tasks = list((proc / str(tree[index]) / "task").iterdir())
        except OSError:
            tasks = []
        for task in tasks:
            try:
                tree.extend(int(child) for child in (task / "children").read_text().split())
            except (OSError, ValueError):
                continue
        index += 1
    return tree


#: The shortest time over which the CPU share is measured. Linux counts CPU time in ticks of
#: 10 ms, so an interval of a few ms would read 0 % or a whole tick's worth (125 % in 8 ms);
#: and reading every process's ``/proc`` files costs a few hundred µs, which a loop logging
#: every few ms would pay each time.
CPU_READ_EVERY_S = 1.0

#: A slot's value for "not known": the all-reduce carries no NaN (NCCL's NaN check would
#: stop every rank on it), and every figure is >= 0.
UNKNOWN = -1.0


def to_slot(values: tuple[float, ...]) -> tuple[float, ...]:
    """``values`` for the all-reduce: NaN as :data:`UNKNOWN`."""
    return tuple(UNKNOWN if math.isnan(value) else value for value in values)


def from_slot(values: Sequence[float]) -> tuple[float, ...]:
    """A slot's values as :meth:`UsageSampler.take` gave them: :data:`UNKNOWN` as NaN."""
    return tuple(math.nan if value < 0 else value for value in values)


def known_mean(values: list[float]) -> float:
    """The mean of the values that are not NaN (NaN where none is)."""
    known = [value for value in values if not math.isnan(value)]
    return sum(known) / len(known) if known else math.nan


def known_max(values: list[float]) -> float:
    """The largest value that is not NaN (NaN where none is)."""
    known = [value for value in values if not math.isnan(value)]
    return max(known) if known else math.nan


class UsageSampler:
    """One rank's readings between :meth:`take` calls. A thread reads, every ``every_s``,
    its GPU (``read_gpu``; None without a GPU) and its processes' memory (``read_memory``);
    a take reads their CPU time (``read_cpu``) where ``cpu_every_s`` has passed since the
    last read, and otherwise gives the share last measured. ``clock`` counts seconds. Every
    reader and the clock are injectable."""

    def __init__(
        self,
        every_s: float,
        idle_percent: float,
        read_gpu: Callable[[], GpuReading] | None,
        read_cpu: Callable[[], float] = process_cpu_s,
        read_memory: Callable[[], float] = process_memory_mib,
        clock: Callable[[], float] = time.monotonic,
        cpu_every_s: float = CPU_READ_EVERY_S,
    ) -> None:
        self.every_s, self.idle_percent, self.cpu_every_s = every_s, idle_percent, cpu_every_s
        self._read_gpu, self._read_cpu, self._read_memory = read_gpu, read_cpu, read_memory
        self._clock = clock
        self._lock = threading.Lock()
        self._gpu: list[GpuReading] = []
        self._last_gpu: GpuReading | None = None
        self._memory = self._last_memory = math.nan
        self._idle_since: float | None = None
        self._first_take = True
        self._cpu_s, self._cpu_read_at = read_cpu(), clock()
        self._cpu_percent: float | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        """Read the GPU and the memory once. A reading that fails is skipped (the driver may
        be busy, a worker may have ended) and counts as no evidence of an idle GPU."""
        try:  # a monitor never stops the training, nor its own thread
            memory = self._read_memory()
        except Exception:
            memory = math.nan
        try:
            reading = self._read_gpu() if self._read_gpu is not None else None
        except Exception:
            reading = None
        now = self._clock()
        with self._lock:
            self._last_memory = memory if not math.isnan(memory) else self._last_memory
            self._memory = known_max([self._memory, memory])
            if reading is None:
                self._idle_since = None
                return
            self._gpu.append(reading)
            self._last_gpu = reading
            # NaN (a MIG slice has no utilisation): no evidence of an idle GPU.
            if not reading.utilization_percent < self.idle_percent:
                self._idle_since = None
            elif self._idle_since is None:
                self._idle_since = now

    def take(self) -> tuple[float, ...]:
        """The figures since the last take, in :data:`USAGE_FIELDS` order (where no sample
        was taken since, the last one stands)."""
        now = self._clock()
        cpu_percent = self._cpu_share(now)
        with self._lock:
            if self._first_take and self._idle_since is not None:
                # The time before the first interval's end holds start-up, compilation and a
                # resume's loading: a GPU waiting through them is not idle.
                self._idle_since = now
            self._first_take = False
            memory = self._last_memory if math.isnan(self._memory) else self._memory
            gpu = self._gpu or ([self._last_gpu] if self._last_gpu else [])
            self._gpu, self._memory = [], math.nan
            idle_s = math.nan if self._idle_since is None else now - self._idle_since
        if not gpu:
            return (cpu_percent, memory, *[math.nan] * 5)
        return (
            cpu_percent,
            memory,
            known_mean([reading.utilization_percent for reading in gpu]),
            known_max([reading.memory_mib for reading in gpu]),
            known_mean([reading.power_w for reading in gpu]),
            known_max([reading.temperature_c for reading in gpu]),
            idle_s,
        )

    def _cpu_share(self, now: float) -> float:
        """The CPU share since the last read, read on the first take and then where
        ``cpu_every_s`` has passed; otherwise the share last read."""
        waited = now - self._cpu_read_at
        if self._cpu_percent is not None and waited < self.cpu_every_s:
            return self._cpu_percent
        cpu_s = self._read_cpu()
        # Never below 0: a worker reaped between the reads takes its time out of the sum.
        self._cpu_percent = max(0.0, 100.0 * (cpu_s - self._cpu_s) / max(waited, 1e-9))
        self._cpu_s, self._cpu_read_at = cpu_s, now
        return self._cpu_percent

    def start(self) -> UsageSampler:
        """Sample now, then on a daemon thread every ``every_s`` until :meth:`close`."""
        self.sample()
        if self.every_s > 0:
            self._thread = threading.Thread(target=self._run, name="hpc_ddp-usage", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stopped.wait(self.every_s):
            self.sample()

    def close(self) -> None:
        """Stop the sampling thread (waiting at most 5 s for a reading in progress)."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
