"""Shared by the benchmarks: start N local ranks exactly as `hpc-ddp local` does, read rank 0's
JSON, take medians, and write results; the models the overhead is measured on, and both
sides' arguments for them."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hpc_ddp.launch.local import free_loopback_port, rank_environments

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"

#: The models the per-step overhead is measured on, with the hand-written loop
#: (bench/raw_ddp.py) and the built-in trainer given the same model, data and batch.
MODELS: dict[str, dict[str, Any]] = {
    "compute_bound": {"hidden": [1024, 1024], "samples": 32768, "epochs": 3},
    "tiny": {"hidden": [32], "samples": 131072, "epochs": 4},
}
BATCH = 256
WORLD = 2


def hpc_ddp_args(hidden: list[int], samples: int, epochs: int) -> list[str]:
    return [
        "--config",
        "configs/synthetic.yaml",
        f"model.hidden_sizes={hidden}",
        f"data.num_samples={samples}",
        f"data.batch_size={BATCH}",
        f"train.epochs={epochs}",
        "optim.name=sgd",
        "optim.lr=0.05",
        "optim.momentum=0.9",
        "optim.weight_decay=0",
        "optim.schedule=constant",
        "optim.warmup_steps=0",
        "optim.grad_clip_norm=null",
        "tracking.enabled=false",
        "checkpoint.enabled=false",
        "run.output_dir=/tmp/hpc-ddp-bench",
    ]


def raw_args(hidden: list[int], samples: int, epochs: int) -> list[str]:
    return [
        "--hidden",
        *map(str, hidden),
        "--samples",
        str(samples),
        "--batch",
        str(BATCH),
        "--epochs",
        str(epochs),
    ]


def base_environ() -> dict[str, str]:
    environment = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_", "HPC_DDP_LOCAL_"))
        and k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    }
    environment["PYTHONPATH"] = str(REPO)
    environment["GLOO_SOCKET_IFNAME"] = "lo"
    return environment


def bench_notes(name: str) -> str:
    """The hand-written reading of a benchmark's figures, bench/notes/<name>.md, for its
    README section ("" when there is none)."""
    path = REPO / "bench" / "notes" / f"{name}.md"
    return path.read_text() + "\n" if path.exists() else ""


def launch(
    nproc: int, module: str, args: list[str], timeout: float = 600
) -> tuple[dict[str, Any], float]:
    """Run ``python -m module args`` on ``nproc`` local ranks.

    Returns rank 0's last JSON object and the Unix time the ranks were spawned.
    """
    environments = rank_environments(
        nproc, base_environ(), free_loopback_port(), f"bench-{time.time_ns()}", os.cpu_count() or 1
    )
    spawned = time.time()
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", module, *args],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for env in environments
    ]
    outputs = [process.communicate(timeout=timeout) for process in processes]
    for process, (_out, err) in zip(processes, outputs, strict=True):
        if process.returncode != 0:
            raise RuntimeError(f"{module} failed:\n{err[-3000:]}")
    return last_json(outputs[0][0]), spawned


def last_json(text: str) -> dict[str, Any]:
    """The last top-level JSON object printed; for a run of the trainer, the summary.json
    its last lines name (``  summary: <path>``)."""
    named = re.findall(r"^  summary: (.+\.json)$", text, re.MULTILINE)
    if named:
        return json.loads(Path(named[-1]).read_text())  # type: ignore[no-any-return]
    start = text.rfind("\n{")
    start = 0 if start < 0 and text.startswith("{") else start + 1
    if text.lstrip().startswith("{") and "\n{" not in text:
        start = text.index("{")
    return json.loads(text[start:])  # type: ignore[no-any-return]


def median(values: list[float]) -> float:
    return statistics.median(values)


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
    }


def write_result(name: str, result: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **result}, indent=2, sort_keys=True) + "\n")
    return path


def lm_example_summary(program_args: list[str], run_id: str, output_dir: Path) -> dict[str, Any]:
    """examples/lm/train.py with ``program_args`` (its options and dotted settings) on one
    local rank as ``run_id`` under ``output_dir``: its summary.json."""
    done = subprocess.run(
        [sys.executable, "-m", "hpc_ddp", "local", "--nproc", "1", "examples/lm/train.py",
         *program_args, f"run.output_dir={output_dir}", f"run.id={run_id}"],
        cwd=REPO, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"examples/lm/train.py ({run_id}) failed:\n{done.stderr[-3000:]}")
    # The example names its experiment: its runs are under output_dir/<experiment>/<run id>.
    (summary_file,) = output_dir.glob(f"*/{run_id}/summary.json")
    return json.loads(summary_file.read_text())  # type: ignore[no-any-return]
