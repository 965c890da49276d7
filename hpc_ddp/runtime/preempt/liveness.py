"""Which ranks still answer. Each rank's watchdog thread writes a count of its "alive" writes
to the rendezvous store every few seconds, over a connection of its own with a short timeout.
When a rank's stall watchdog fires, it reads the others' counts twice, some seconds apart on
its own monotonic clock, so its report names a rank that stopped answering (SIGSTOP, a frozen
node) instead of only itself, which merely waits for that rank in a collective. No clock is
compared across hosts: one an hour behind names no one.

Each write carries the rank's node (Slurm's name for it: a frozen node's rank is named with
it, and the batch script leaves that node out) and its place (in the training loop, or out
of it after a step and why), so a report also names a rank that left the loop while the
others went on: its batches ran out first, or it broke out of the loop.

A rank also tells whether its own process ran (:class:`ProcessStops`): time in which it was
stopped is not a stall of its own."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

#: How long one store call may take before the store counts as not answering.
STORE_TIMEOUT_S = 5.0
#: A look this late after the one before means the process did not run meanwhile (a busy
#: machine delays a thread by far less).
NOT_RUNNING_S = 5.0


IN_LOOP = "in the training loop"


def publish_period_s(world_size: int) -> float:
    """Seconds between a rank's "alive" writes: 1 s, longer for large jobs so that rank 0's
    store takes at most about 200 writes a second."""
    return max(1.0, world_size / 200)


class Liveness:
    """This rank's "alive" writes, and the others' as read at a stall (see the module
    docstring). Best effort: a store call may block until its STORE_TIMEOUT_S (a stopped
    store host leaves the connection open), so after the first write, made as training starts,
    every call runs on a thread of its own."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        attempt: int,
        between_reads: Callable[[float], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
        node: str = "",
    ) -> None:
        self.host, self.port = host, port
        #: This rank's node (Slurm's name for it), named when it stops answering.
        self.node = node.split()[0] if node.strip() else "?"
        self.rank, self.world_size = rank, world_size
        self.period_s = publish_period_s(world_size)
        #: A rank that made no write in this long is silent.
        self.limit_s = max(3.0, 3 * self.period_s)
        self._prefix = f"hpc_ddp/alive/{attempt}/"
        self._client: Any = None
        self._first: float | None = None
        self._writes = 0
        #: Where this rank is, as the others' reports show it (see :meth:`left_loop`).
        self._place = IN_LOOP
        self._closed = threading.Event()
        self._wake = threading.Event()
        #: Waits the given seconds between the two reads of a stall report.
        self._between_reads = between_reads or self._closed.wait
        self._clock = clock
        # The first write before training starts, not whenever the thread gets to it: a rank
        # that stops at its first steps has written once, and is named with its time.
        self._alive = self._write()
        self._thread = threading.Thread(target=self._publish, name="hpc_ddp-alive", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._wake.set()

    def entered_loop(self) -> None:
        self._place = IN_LOOP

    def left_loop(self, why: str) -> None:
        """This rank left the training loop, ``why`` (e.g. "after step 5: its batches ran
        out"); the next write tells the others."""
        self._place = f"left the training loop {why}"
        self._wake.set()  # written now, not at the next period

    def _store(self) -> Any:
        if self._client is None:
            from torch.distributed import TCPStore  # type: ignore[attr-defined]

            self._client = TCPStore(
                self.host,
                self.port,
                is_master=False,
                timeout=timedelta(seconds=STORE_TIMEOUT_S),
                wait_for_workers=False,
            )
        return self._client

    def _write(self) -> bool:
        """Write this rank's "alive" time once; False when the store is away (silent_ranks
        says so when it matters)."""
        try:
            value = f"{self._writes + 1} {self.node} {self._place}"
            self._store().set(f"{self._prefix}{self.rank}", value)
        except Exception:
            return False
        self._writes += 1
        if self._first is None:
            self._first = self._clock()
        return True

    def _publish(self) -> None:
        """Write this rank's "alive" time every period until closed (or the store fails)."""
        while self._alive:
            self._wake.wait(self.period_s)
            self._wake.clear()
            if self._closed.is_set():
                return
            self._alive = self._write()

    def silent_ranks(self) -> str:
        """The other ranks that stopped answering, in words ("" when all answer); waits at
        most STORE_TIMEOUT_S for the store."""
        silent: list[str] = []
        left: list[str] = []
        reader = threading.Thread(target=self._read, args=(silent, left), daemon=True)
        reader.start()
        reader.join(2 * STORE_TIMEOUT_S + self.limit_s)
        if reader.is_alive() or silent == ["unreachable"]:
            return (
                f"the rendezvous store at {self.host}:{self.port} does not answer either: "
                "the rank that holds it (rank 0, or torchrun's agent) stopped or its host is "
                "gone"
            )
        said = []
        if silent:
            shown = ", ".join(silent[:8]) + (", ..." if len(silent) > 8 else "")
            said.append(
                f"these ranks stopped answering: {shown} (stopped, frozen, or their host is "
                "gone); this rank waits for them"
            )
        if left:
            said.append(
                "; ".join(left[:8]) + " while this rank went on: every rank must take the same "
                "steps (iterables of the same length on every rank, no break on some only)"
            )
        return "; ".join(said)

    def _read(self, silent: list[str], left: list[str]) -> None:
        """The other ranks that did not write between two reads, and those that left the
        training loop, in words."""
        others = [rank for rank in range(self.world_size) if rank != self.rank]
        try:
            store = self._store()
            before = self._counts(store, others)
            self._between_reads(self.limit_s)
            after = self._counts(store, others)
        except Exception:
            silent[:] = ["unreachable"]
            return
        # Ranks that never wrote count once every rank has had the time to.
        first = self._first
        everyone_had_time = first is not None and self._clock() - first >= self.limit_s
        for rank in others:
            count, _, written = (after[rank] or b"").decode(errors="replace").partition(" ")
            node, _, place = written.partition(" ")
            if after[rank] is None:
                if everyone_had_time:
                    silent.append(f"rank {rank} (never)")
            elif count == (before[rank] or b"").decode(errors="replace").partition(" ")[0]:
                silent.append(f"rank {rank} on {node} (silent for {self.limit_s:.0f} s)")
            if place.startswith("left "):
                left.append(f"rank {rank} {place}")

    def _counts(self, store: Any, ranks: list[int]) -> dict[int, bytes | None]:
        """Each rank's count of "alive" writes (None: it made none)."""
        keys = {rank: f"{self._prefix}{rank}" for rank in ranks}
        return {rank: store.get(key) if store.check([key]) else None for rank, key in keys.items()}


class RunQueueWaits:
    """Seconds this process's threads (``threads()``' ids; None: all) have waited, runnable,
    for a CPU since the first call: each thread's growth of the kernel's ``run_delay``
    (/proc/self/task/<id>/schedstat) added up, so a thread that ends keeps its part and one
    that begins counts from 0; 0.0 where the kernel keeps none. Any thread may call it."""

    def __init__(
        self,
        tasks: Path = Path("/proc/self/task"),
        threads: Callable[[], Iterable[str]] | None = None,
    ) -> None:
        self._tasks = tasks
        self._threads = threads
        self._lock = threading.Lock()
        #: Each live thread's run_delay at the last call (None: not called yet).
        self._seen: dict[str, int] | None = None
        self._total_ns = 0

    def __call__(self) -> float:
        with self._lock:
            now = self._read()
            seen = self._seen
            if seen is not None:
                for thread, waited in now.items():
                    before = seen.get(thread, 0)
                    self._total_ns += waited - before if waited >= before else waited
            self._seen = now
            return self._total_ns / 1e9

    def _read(self) -> dict[str, int]:
        waits: dict[str, int] = {}
        with contextlib.suppress(OSError):
            threads = os.listdir(self._tasks) if self._threads is None else self._threads()
            for thread in threads:
                try:
                    waits[thread] = int((self._tasks / thread / "schedstat").read_text().split()[1])
                except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
                    continue
        return waits


class ProcessStops:
    """The time in which this process did not run, as the looks of one thread that looks
    every ``period_s`` find it: a look more than NOT_RUNNING_S after the one before, with the
    process's CPU time (``cpu_clock``) and the wait for a CPU (``waiting_clock``; by default
    its main thread's, the likeliest to hold the interpreter, and the looking thread's: a
    few microseconds a look) grown by less than half of that, finds the process stopped in
    between (SIGSTOP, ``scontrol suspend``, a host that hung), for all but one period of
    that time. A late look after CPU time was used is a thread that held the interpreter
    that long, and one after a wait for a CPU is a busy machine: the process ran, or would
    have. Other threads read the total (:meth:`total_at`)."""

    def __init__(
        self,
        period_s: float,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.process_time,
        waiting_clock: Callable[[], float] | None = None,
    ) -> None:
        self.period_s = period_s
        self._clock, self._cpu_clock = clock, cpu_clock
        #: The looking thread's id (None before its first look).
        self._looker: int | None = None
        watched = RunQueueWaits(threads=self._watched_threads)
        self._waiting_clock = watched if waiting_clock is None else waiting_clock
        #: (the last look's time and CPU time plus wait for a CPU, None when no thread
        #: looks; the seconds this process did not run, in all): replaced whole by the
        #: looking thread, read whole by others without a lock.
        self._state: tuple[tuple[float, float] | None, float] = (None, 0.0)

    def _watched_threads(self) -> list[str]:
        looker = [] if self._looker is None else [str(self._looker)]
        return list(dict.fromkeys([str(os.getpid()), *looker]))

    def _wanted_cpu(self) -> float:
        return self._cpu_clock() + self._waiting_clock()

    def _late(self, looked: tuple[float, float] | None, now: float) -> float:
        """Seconds this process did not run between the look ``looked`` and ``now``."""
        if looked is None:
            return 0.0
        late = now - looked[0] - self.period_s
        if late <= NOT_RUNNING_S - self.period_s:
            return 0.0
        return late if self._wanted_cpu() - looked[1] < late / 2 else 0.0

    def look(self, now: float | None = None) -> float:
        """Seconds the process did not run between the last look and this one, at ``now``
        (the clock's time by default); 0.0: it ran, or this is the first look."""
        now = self._clock() if now is None else now
        self._looker = threading.get_native_id()
        looked, total = self._state
        stopped = self._late(looked, now)
        self._state = ((now, self._wanted_cpu()), total + stopped)
        return stopped

    def stop_looking(self) -> None:
        """The looks end (called by the looking thread): :meth:`total_at` counts no stop
        after the last one."""
        self._state = (None, self._state[1])

    def so_far(self) -> float:
        """Seconds this process did not run, in all, up to now (:meth:`total_at` the clock's
        time)."""
        return self.total_at(self._clock())

    def total_at(self, now: float) -> float:
        """Seconds this process did not run, in all, up to ``now``: with a stop the looking
        thread has not looked at yet (woken from it with the rest of the process, it looks
        within a period, but another thread may read first)."""
        looked, total = self._state
        if looked is None or now - looked[0] <= NOT_RUNNING_S:  # as at nearly every beat
            return total
        return total + self._late(looked, now)
