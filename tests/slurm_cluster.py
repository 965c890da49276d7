"""Client side of the test Slurm cluster (tests/cluster/cluster.py starts it)."""

from __future__ import annotations

import getpass
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO, clean_environ

DEFAULT_CONF = REPO / ".cluster" / "slurm.conf"
TERMINAL_STATES = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
)


def cluster_unavailable_reason(conf: Path) -> str | None:
    if shutil.which("sbatch") is None:
        return "Slurm client commands are not installed (run `make cluster-up` as root)"
    if not conf.is_file():
        return f"no test cluster: {conf} does not exist (run `make cluster-up`)"
    result = subprocess.run(
        ["sinfo", "-h", "-o", "%t"],
        env={**os.environ, "SLURM_CONF": str(conf)},
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    if result.returncode != 0:
        return f"the test cluster at {conf} does not answer: {result.stderr.strip()[:200]}"
    return None


@dataclass
class SlurmCluster:
    conf: Path

    def environ(self, workdir: Path | None = None, **extra: str) -> dict[str, str]:
        """Environment for clients and, through --export=ALL, for the jobs' tasks."""
        venv_bin = str(Path(sys.executable).parent)
        return clean_environ(
            SLURM_CONF=str(self.conf), PATH=f"{venv_bin}:{os.environ['PATH']}", **extra
        )

    def run(
        self, command: list[str], cwd: Path, timeout: float = 120, **extra: str
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            command,
            cwd=cwd,
            env=self.environ(cwd, **extra),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def cancel_all(self) -> None:
        """Cancel every pending or running job of the (private) test cluster."""
        self.run(["scancel", "--user", getpass.getuser()], REPO, timeout=30)

    def sbatch(self, args: list[str], cwd: Path) -> str:
        result = self.run(["sbatch", "--parsable", *args], cwd)
        assert result.returncode == 0, f"sbatch failed: {result.stderr}"
        return result.stdout.strip().split(";")[0]

    def job_field(self, job_id: str, name: str) -> str:
        result = self.run(["scontrol", "show", "job", "-o", job_id], REPO, timeout=20)
        match = re.search(rf"\b{name}=(\S+)", result.stdout)
        return match.group(1) if match else ""

    def state(self, job_id: str) -> str:
        return self.job_field(job_id, "JobState")

    def wait(self, job_id: str, timeout: float = 180) -> str:
        """Wait for the job to end; returns its final state."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state(job_id)
            if state.startswith(TERMINAL_STATES) and state != "PREEMPTED":
                return state
            time.sleep(0.5)
        self.run(["scancel", job_id], REPO)
        pytest.fail(
            f"job {job_id} did not finish within {timeout:.0f} s (state {self.state(job_id)})"
        )

    def job_starts(self, job_id: str, count: int, timeout: float = 60) -> list[float]:
        """When the job started each time (Unix; one start a requeue), from Slurm's
        accounting once it lists ``count`` of them (its records arrive after the job's)."""
        deadline = time.monotonic() + timeout
        command = ["sacct", "--duplicates", "--allocations", "--noheader", "--parsable2",
                   "--jobs", job_id, "--format", "Start"]  # fmt: skip
        starts: list[str] = []
        while time.monotonic() < deadline:
            result = self.run(command, REPO, timeout=20, SLURM_TIME_FORMAT="%s")
            starts = [line for line in result.stdout.split() if line.isdigit()]
            if len(starts) >= count:
                return [float(start) for start in starts]
            time.sleep(0.5)
        pytest.fail(f"Slurm's accounting listed {len(starts)} of job {job_id}'s {count} starts "
                    f"within {timeout:.0f} s: {starts}")  # fmt: skip

    def wait_for_log(self, path: Path, pattern: str, timeout: float = 120, since: int = 0) -> str:
        """The log once ``pattern`` appears in it after its first ``since`` characters."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists() and re.search(pattern, path.read_text()[since:]):
                return path.read_text()
            time.sleep(0.3)
        pytest.fail(f"{pattern!r} did not appear in {path} within {timeout:.0f} s")

    def requeue_by_signal(
        self, job_id: str, workdir: Path, log_path: Path, under_way: str, timeout: float = 120
    ) -> tuple[str, int]:
        """``scancel --signal=USR1`` the job once its log matches ``under_way``; it must be
        requeued once and complete. Returns its log and the step of its stop checkpoint."""
        self.wait_for_log(log_path, under_way, timeout=timeout)
        assert self.run(["scancel", "--signal=USR1", job_id], workdir).returncode == 0
        state = self.wait(job_id, timeout=300)
        log = log_path.read_text()
        assert state == "COMPLETED", log[-4000:]
        assert f"requeued job {job_id}" in log, log[-4000:]
        assert self.job_field(job_id, "Restarts") == "1"
        stopped = re.search(r"checkpoint \(stop signal\) step (\d+)", log)
        assert stopped is not None, log[-4000:]
        return log, int(stopped.group(1))


def prepare_workdir(path: Path) -> Path:
    """A submission directory like a user's project: configs/ and no logs/ folder (the
    templates as checked in write the job's log beside the configs)."""
    shutil.copytree(REPO / "configs", path / "configs")
    return path
