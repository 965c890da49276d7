"""The job's end as Slurm has it: read at the start and re-read in the background, so rank 0
can stop the ranks with a checkpoint and requeue before the time limit, whether or not the
site sends a warning signal, and after ``scontrol update TimeLimit`` too."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hpc_ddp.runtime.config import PreemptConfig
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.place.slurm import ask_slurm, queue_job_id

#: What a save not measured yet is assumed to take.
UNMEASURED_SAVE_S = 30.0
#: A re-read end that moved less than this is the same end (squeue counts whole seconds).
SAME_END_S = 5.0
#: Seconds one squeue may take.
SQUEUE_TIMEOUT_S = 20.0

_TIME_LEFT = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)$")


def parse_time_left(text: str) -> float | None:
    """Seconds in squeue's ``%L`` ("[days-][hours:]minutes:seconds"); None for UNLIMITED,
    NOT_SET, INVALID or anything else."""
    match = _TIME_LEFT.match(text.strip())
    if match is None:
        return None
    days, hours, minutes, seconds = (int(part or 0) for part in match.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def left_from_environ(environ: Mapping[str, str], now_unix: float) -> float | None:
    """Seconds to ``SLURM_JOB_END_TIME`` (Unix; Slurm 23.02 and later set it), or None."""
    value = environ.get("SLURM_JOB_END_TIME", "").strip()
    if not value.isdigit() or int(value) == 0:
        return None
    return int(value) - now_unix


def squeue_time_left(job: str, timeout_s: float = SQUEUE_TIMEOUT_S) -> float | None:
    """Seconds before Slurm ends ``job`` (its time limit as it is now), or None when squeue
    does not answer or the job has no limit."""
    answer = ask_slurm(["squeue", "--noheader", "--jobs", job, "--format", "%L"], timeout_s)
    lines = answer.output.strip().splitlines()
    return parse_time_left(lines[0]) if answer.failure is None and lines else None


@dataclass(frozen=True)
class StopTime:
    """How long before the job's end the stop must begin, and why."""

    save_s: float
    save_measured: bool
    steps_s: float
    margin_s: float

    @property
    def seconds(self) -> float:
        return self.save_s + self.steps_s + self.margin_s

    def reason(self) -> str:
        save = "measured" if self.save_measured else "not measured yet"
        return (
            f"{self.seconds:.0f} s (a checkpoint: {self.save_s:.0f} s, {save}; two stop "
            f"checks: {self.steps_s:.0f} s; preempt.end_margin_s: {self.margin_s:.0f} s)"
        )


def stop_time(save_s: float | None, check_period_s: float, margin_s: float) -> StopTime:
    """The time a stop needs: the last save's (or UNMEASURED_SAVE_S before one), two check
    periods (a stop lands within two), and the margin."""
    if save_s is None:
        return StopTime(UNMEASURED_SAVE_S, False, 2 * check_period_s, margin_s)
    return StopTime(save_s, True, 2 * check_period_s, margin_s)


class JobEnd:
    """When this job ends, as a ``clock`` instant, kept current by re-reading ``read_left``
    (the seconds left) every ``every_s`` in a background thread (None: read once)."""

    def __init__(
        self,
        read_left: Callable[[], float | None],
        every_s: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read_left = read_left
        self._every_s = every_s
        self._clock = clock
        self.end: float | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> None:
        """Read the end again; a new end is kept and said, an unanswered read changes
        nothing.

        The answer counts from when the read began (Slurm's answer came at most the read's
        length later), so a new end is not placed later than it is; a read that took long is
        only as precise as its length, so it moves the end only by more than that (a smaller
        move waits for the next, quicker read)."""
        asked = self._clock()
        left = self._read_left()
        if left is None:
            return
        read_s = self._clock() - asked
        end, before = asked + left, self.end
        if before is not None and abs(end - before) < SAME_END_S + read_s:
            return
        self.end = end
        if before is not None:
            get_logger().info(
                f"the job's end moved {end - before:+.0f} s: it now ends at {wall_time(left)} "
                f"(in {left:.0f} s)"
            )

    def left(self) -> float | None:
        """Seconds to the end, or None when it is not known."""
        return None if self.end is None else self.end - self._clock()

    def start(self) -> JobEnd:
        """Read now, then keep reading in the background."""
        self.refresh()
        if self._every_s is not None:
            self._thread = threading.Thread(target=self._keep_reading, name="hpc_ddp-job-end")
            self._thread.daemon = True
            self._thread.start()
        return self

    def _keep_reading(self) -> None:
        assert self._every_s is not None
        while not self._closed.wait(self._every_s):
            try:
                self.refresh()
            except Exception as error:  # a reader's fault must not end the re-reads
                get_logger().warning(f"reading the job's end failed: {error}")

    def close(self) -> None:
        self._closed.set()


class StopBeforeEnd:
    """Rank 0's watch on the job's end: when the stop will come, and whether it is due now
    (the time left is what a stop needs: ``save_s()``, two of the longest gaps between stop
    checks seen after the first, ``margin_s``). An end already nearer than that at the first
    check is left to Slurm's signals (a stop at once would only requeue the job again and
    again); a later move of the end arms the watch again. ``stopped_s(now)``: the seconds
    this process did not run, in all, up to ``now`` (a suspended job: no gap between checks,
    and Slurm moves the job's end by it, read again at the next check)."""

    def __init__(
        self,
        job_end: JobEnd,
        save_s: Callable[[], float | None],
        margin_s: float,
        clock: Callable[[], float] = time.monotonic,
        stopped_s: Callable[[float], float] = lambda now: 0.0,
    ) -> None:
        self.job_end = job_end
        self._save_s = save_s
        self._margin_s = margin_s
        self._clock = clock
        self._stopped_s = stopped_s
        self._stopped_at_check = 0.0
        self._last_check: float | None = None
        self._longest_gap = 0.0
        self._end_too_near: float | None = None

    def say_when(self) -> None:
        """The run's line on the job's end and when the stop will come."""
        left = self.job_end.left()
        if left is None:
            get_logger().info("the job's end is not known (no time limit, or squeue did not say)")
            return
        needed = stop_time(self._save_s(), 0.0, self._margin_s)
        get_logger().info(
            f"the job ends at {wall_time(left)} (in {left:.0f} s): the ranks stop with a "
            f"checkpoint and requeue once about {needed.reason()} are left "
            "(preempt.stop_before_end)"
        )

    def due(self) -> bool:
        """Whether the stop must begin now (said once when it must); called at each stop
        check, whose spacing it measures (the first gap holds the warm-up: not counted)."""
        now, first = self._clock(), self._last_check is None
        stopped = self._stopped_s(now)
        if self._last_check is not None:
            not_running = stopped - self._stopped_at_check
            self._longest_gap = max(self._longest_gap, now - self._last_check - not_running)
            if not_running >= SAME_END_S:  # not a few more seconds of a stop already seen
                self.job_end.refresh()
        self._last_check, self._stopped_at_check = now, stopped
        left, end = self.job_end.left(), self.job_end.end
        if left is None or end == self._end_too_near:
            return False
        needed = stop_time(self._save_s(), self._longest_gap, self._margin_s)
        if left > needed.seconds:
            return False
        if first:
            self._end_too_near = end
            get_logger().warning(
                f"the job ends in {left:.0f} s, sooner than a stop needs ({needed.reason()}): "
                "training goes on and Slurm's warning signal or SIGTERM stops it. HINT: ask "
                "for a longer --time, or lower preempt.end_margin_s"
            )
            return False
        get_logger().warning(
            f"stopping before the job's time limit: it ends at {wall_time(left)} (in "
            f"{left:.0f} s), and a stop needs {needed.reason()}"
        )
        return True

    def close(self) -> None:
        self.job_end.close()


def wall_time(seconds_from_now: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(time.time() + seconds_from_now))


def job_end_for(environ: Mapping[str, str], config: PreemptConfig) -> JobEnd | None:
    """The job's end for rank 0 of a Slurm job (``preempt.stop_before_end``), else None.
    The first read is the environment's where Slurm sets one; later ones ask squeue."""
    job = queue_job_id(environ)
    if job is None or not config.stop_before_end:
        return None
    from_environ = left_from_environ(environ, time.time())
    started = False

    def read_left() -> float | None:
        nonlocal started
        if not started:  # at the start, which the ranks wait for: the environment, or a quick ask
            started = True
            return from_environ if from_environ is not None else squeue_time_left(job, 5.0)
        return squeue_time_left(job)

    return JobEnd(read_left, config.end_check_every_s)
