"""Shared test helpers: run the real entry points as subprocesses with a clean environment."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

#: A run of the built-in trainer that can be stopped mid-epoch and resumed (3 epochs of 200
#: steps at one rank, checkpoints every 50 steps).
RESUMABLE = [
    "data.num_samples=12800",
    "data.batch_size=64",
    "train.epochs=3",
    "train.log_interval=8",
    "optim.schedule=cosine",
    "optim.warmup_steps=10",
    "checkpoint.every_steps=50",
    # Agree on stop signals after every step, so a stop lands mid-epoch whatever the speed.
    "preempt.check_every_steps=1",
]

# Variables a launcher sets; a test process must never pass its own to the ranks it starts.
LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "HPC_DDP_LOCAL_", "SBATCH_", "SRUN_", "SALLOC_")
LAUNCHER_NAMES = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "CUDA_VISIBLE_DEVICES",
    "SLURMD_NODENAME",
}


def clean_environ(**extra: str) -> dict[str, str]:
    """os.environ without launcher variables, plus ``extra``; runs on loopback, 1 thread."""
    environment = {
        key: value
        for key, value in os.environ.items()
        if key not in LAUNCHER_NAMES and not key.startswith(LAUNCHER_PREFIXES)
    }
    environment.setdefault("GLOO_SOCKET_IFNAME", "lo")
    environment["PYTHONPATH"] = str(REPO)
    environment.update(extra)
    return environment


def run_local(
    nproc: int,
    output_dir: Path,
    overrides: list[str],
    config: str = "configs/synthetic.yaml",
    timeout: float = 240,
    environment: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`hpc-ddp local --nproc N` exactly as a user runs it."""
    program = ["--config", str(REPO / config), f"run.output_dir={output_dir}", *overrides]
    return run_local_program(nproc, program, timeout, environment)


def run_python(
    arguments: list[str],
    cwd: Path = REPO,
    environment: dict[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """``python ARGUMENTS`` in ``cwd`` (default: without any launcher's variables), its
    output kept."""
    return subprocess.run(
        [sys.executable, *arguments],
        cwd=cwd,
        env=clean_environ() if environment is None else environment,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_local_program(
    nproc: int,
    program: list[str],
    timeout: float = 240,
    environment: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`hpc-ddp local --nproc N <program...>`: a user's script or module on local ranks."""
    command = ["-m", "hpc_ddp", "local", "--nproc", str(nproc), *program]
    return run_python(command, environment=environment or clean_environ(), timeout=timeout)


def ran_on_ranks(
    nproc: int, tmp_path: Path, program: str, *settings: str
) -> tuple[str, list[dict[str, Any]]]:
    """``program`` run on ``nproc`` local ranks without the system monitor: what it printed,
    and the metrics.jsonl entries of its run."""
    script = tmp_path / "program.py"
    script.write_text(program)
    settings = (f"run.output_dir={tmp_path}", "monitor.every_s=0", *settings)
    options = [arg for setting in settings for arg in ("--set", setting)]
    result = run_local_program(nproc, [*options, str(script)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    [record] = tmp_path.glob("*/*/metrics.jsonl")
    return result.stderr, [json.loads(line) for line in record.read_text().splitlines()]


def run_train(
    args: list[str], environment: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`python -m hpc_ddp.train ...` in one process, with the given environment."""
    return run_python(["-m", "hpc_ddp.train", *args], environment=environment, timeout=timeout)


def summary_path(output_dir: Path, name: str = "*", run_id: str = "*") -> Path:
    """The one ``<output_dir>/<name>/<run_id>/summary.json`` (either may be a glob pattern:
    by default, the one run under ``output_dir``)."""
    paths = sorted(output_dir.glob(f"{name}/{run_id}/summary.json"))
    assert len(paths) == 1, f"expected one summary.json under {output_dir}/{name}/{run_id}: {paths}"
    return paths[0]


def read_summary(output_dir: Path, name: str = "*", run_id: str = "*") -> dict[str, Any]:
    """The summary.json of :func:`summary_path`, as the run wrote it."""
    return json.loads(summary_path(output_dir, name, run_id).read_text())  # type: ignore[no-any-return]


def start_local(nproc: int, output_dir: Path, overrides: list[str]) -> subprocess.Popen[str]:
    """The built-in trainer on configs/synthetic.yaml under `hpc-ddp local`, started."""
    config = ["--config", str(REPO / "configs" / "synthetic.yaml"), f"run.output_dir={output_dir}"]
    return start_program(nproc, [*config, *overrides])


def start_program(
    nproc: int, program: list[str], environment: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """`hpc-ddp local --nproc N <program...>`, started; see :func:`signal_after`."""
    return subprocess.Popen(
        [sys.executable, "-m", "hpc_ddp", "local", "--nproc", str(nproc), *program],
        cwd=REPO,
        env=environment or clean_environ(),
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


class HandClock:
    """A clock the test moves by hand (``clock.now += 5``): time-based behaviour with no
    verdict that depends on the machine's pace."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Lines:
    """One output stream of a started process, read line by line on a thread of its own: a
    wait for a line gives up at its deadline even when the process falls silent."""

    def __init__(self, process: subprocess.Popen[str], stream: str = "stderr") -> None:
        self.process = process
        self.seen: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        source = getattr(process, stream)
        assert source is not None, f"start the process with {stream}=subprocess.PIPE"
        self._reader = threading.Thread(target=self._read, args=(source,), daemon=True)
        self._reader.start()

    def _read(self, source: Any) -> None:
        for line in source:
            self._lines.put(line)
        self._lines.put(None)

    def wait_for(self, pattern: str, timeout: float = 240) -> str:
        """The first new line that matches ``pattern``; fails, with the lines read so far, if
        the stream ends or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = ""
            if not line:
                ended = "the stream ended" if line is None else f"{timeout:.0f} s passed"
                raise AssertionError(
                    f"{pattern!r} was not seen ({ended}):\n" + "".join(self.seen[-40:])
                )
            self.seen.append(line)
            if re.search(pattern, line):
                return line

    def all(self, timeout: float = 240) -> str:
        """Everything the stream held, once the process ended (within ``timeout``)."""
        self.process.wait(timeout=timeout)
        self._reader.join(timeout=timeout)
        while not self._lines.empty():
            line = self._lines.get_nowait()
            if line is not None:
                self.seen.append(line)
        return "".join(self.seen)


def signal_after(
    process: subprocess.Popen[str], pattern: str, signum: int, timeout: float = 240
) -> str:
    """Send ``signum`` once a line of stderr matches ``pattern`` (within ``timeout``, or
    fail with what was read); the whole stderr once the process ended."""
    lines = Lines(process)
    lines.wait_for(pattern, timeout)
    process.send_signal(signum)
    return lines.all(timeout)


def run_with_metrics(tmp_path: Path, entries: list[dict[str, float]]) -> Path:
    """A finished run's folder whose metrics.jsonl holds ``entries``, one interval every 10
    steps (each with a falling ``interval/loss``), for the views to read."""
    run_dir = tmp_path / "runs" / "lm" / "a"
    run_dir.mkdir(parents=True)
    (run_dir / "status.json").write_text(json.dumps({"state": "finished", "global_step": 30}))
    lines = [json.dumps({"step": 10 * n, "global_step": 10 * n, "epoch": 0, "time": 1.0,
                         "metrics": {"interval/loss": 2.0 / n, **metrics}})
             for n, metrics in enumerate(entries, 1)]  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir
