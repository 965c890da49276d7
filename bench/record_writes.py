"""Benchmark: what rank 0's record (metrics.jsonl, status.json) costs the training thread
at each log interval.

One process, a run directory in the home folder: rank 0's journal logs an interval's
metrics (12 of them, as the monitor's interval line has), with a short pause between
calls for the steps in between. Each call is timed as the training thread sees it: with the
files written by the journal's background thread (as runs do), and with the thread waiting
until they are written (the files written in line, as before the background thread).
Rank 0's time here is every rank's: the others wait for it at the next collective.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import write_result

CALLS = 2000
METRICS = 12
#: Seconds between two intervals' calls (the steps in between).
BETWEEN_S = 0.001


def _timed_calls(waits_for_files: bool) -> list[float]:
    from hpc_ddp.runtime.tracking.base import NullTracker
    from hpc_ddp.runtime.tracking.journal import JournalTracker

    metrics = {f"interval/metric_{index}": 0.5 for index in range(METRICS)}
    with tempfile.TemporaryDirectory(dir=Path.home(), prefix="bench-record-") as where:
        journal = JournalTracker(NullTracker(), Path(where) / "name" / "id", lambda: (1, 0), "1", 2)
        seconds = []
        for step in range(CALLS):
            started = time.perf_counter()
            journal.log_metrics(metrics, step)
            if waits_for_files:
                journal.flush()
            seconds.append(time.perf_counter() - started)
            time.sleep(BETWEEN_S)
        journal.finish("FINISHED")
        lines = (Path(where) / "name" / "id" / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == CALLS + 1, f"{len(lines)} lines written, {CALLS + 1} expected"
    return seconds


def _figures(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "median_us": statistics.median(ordered) * 1e6,
        "p99_us": ordered[int(0.99 * len(ordered))] * 1e6,
    }


def run() -> dict[str, Any]:
    figures = {
        "background": _figures(_timed_calls(waits_for_files=False)),
        "in_line": _figures(_timed_calls(waits_for_files=True)),
    }
    for how, found in figures.items():
        print(f"{how}: {found['median_us']:.0f} us median, {found['p99_us']:.0f} us p99")
    result: dict[str, Any] = {"calls": CALLS, "metrics": METRICS, **figures}
    write_result("record_writes", result)
    return result


if __name__ == "__main__":
    run()
