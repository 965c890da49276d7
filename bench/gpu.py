"""GPU figures; needs a CUDA GPU (none: exits 2 and says so).

1. The NCCL path at world size 1 through the same entry point every launcher runs
   (`python -m hpc_ddp.train`), bf16, checkpoints and MLflow on: the facts its summary
   records (backend, device, replica check, accuracy) and samples/s.
2. Overhead on CUDA with bf16: hpc_ddp vs `bench/raw_ddp.py --device cuda --bf16` on the same
   model, data, batch and loader workers, alternating A/B, median samples/s and the ratio.

    python -m bench.gpu [REPEATS] && python -m bench.report   # bench/results/gpu.json, README
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from typing import Any

from bench.harness import hpc_ddp_args, launch, median, raw_args, write_result

#: Large enough that the GPU's work, not Python, sets a step's time; the data loader has
#: workers so that collating batches on the CPU overlaps the steps.
MODELS: dict[str, dict[str, Any]] = {
    "gpu_bound": {"hidden": [4096, 4096], "samples": 262144, "epochs": 2},
    "launch_bound": {"hidden": [1024, 1024], "samples": 131072, "epochs": 2},
}
BATCH = 1024
WORKERS = 4


def gpu_facts() -> dict[str, Any] | None:
    """The GPU's name and the versions that matter, or None without a usable GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    return {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
    }


def _hpc_ddp(model: dict[str, Any], extra: list[str]) -> list[str]:
    """bench.harness's arguments; a later override of the same key wins."""
    return [
        *hpc_ddp_args(model["hidden"], model["samples"], model["epochs"]),
        f"data.batch_size={BATCH}",
        "train.precision=bf16",
        f"data.num_workers={WORKERS}",
        *extra,
    ]


def _raw(model: dict[str, Any]) -> list[str]:
    """bench.harness's arguments; argparse keeps the last --batch."""
    return [
        *raw_args(model["hidden"], model["samples"], model["epochs"]),
        "--batch",
        str(BATCH),
        "--device",
        "cuda",
        "--bf16",
        "--workers",
        str(WORKERS),
    ]


def nccl_single(output_dir: str) -> dict[str, Any]:
    """One full run at world size 1 with everything on; the summary's facts.

    MLflow tracking is on where mlflow is installed (a GPU machine's image may lack it)."""
    tracking = importlib.util.find_spec("mlflow") is not None
    summary, _spawned = launch(
        1,
        "hpc_ddp.train",
        _hpc_ddp(
            MODELS["gpu_bound"],
            [
                f"run.output_dir={output_dir}",
                f"tracking.enabled={str(tracking).lower()}",
                "checkpoint.enabled=true",
                "checkpoint.every_steps=100",
            ],
        ),
    )
    facts = [
        "backend",
        "device",
        "world_size",
        "global_step",
        "val_loss",
        "val_accuracy",
        "replicas_in_sync",
        "samples_per_s",
        "mlflow_run_id",
    ]
    return {"tracking": tracking, **{fact: summary.get(fact) for fact in facts}}


def overhead(repeats: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, model in MODELS.items():
        hpc, raw = [], []
        for _ in range(repeats):
            raw.append(launch(1, "bench.raw_ddp", _raw(model))[0]["samples_per_s"])
            hpc.append(launch(1, "hpc_ddp.train", _hpc_ddp(model, []))[0]["samples_per_s"])
        results[name] = {
            "hidden": model["hidden"],
            "raw_samples_per_s": raw,
            "hpc_ddp_samples_per_s": hpc,
            "ratio": median(hpc) / median(raw),
        }
        print(f"{name}: ratio {median(hpc) / median(raw):.3f}", flush=True)
    return results


def gpu_or_refusal(program: str) -> dict[str, Any] | None:
    """:func:`gpu_facts`; without a usable GPU, None after ``program`` says so."""
    facts = gpu_facts()
    if facts is None:
        print(
            f"{program}: error: no CUDA GPU is visible (torch.cuda.is_available() is False)\n"
            "HINT: run it on a machine with a GPU and a CUDA build of torch",
            file=sys.stderr,
        )
    return facts


def run(repeats: int = 5) -> dict[str, Any] | None:
    facts = gpu_or_refusal("bench.gpu")
    if facts is None:
        return None
    with tempfile.TemporaryDirectory() as output_dir:
        single = nccl_single(output_dir)
    print(f"nccl world size 1: {single}", flush=True)
    result = {
        **facts,
        "global_batch": BATCH,
        "loader_workers": WORKERS,
        "repeats": repeats,
        "nccl_single": single,
        "overhead": overhead(repeats),
    }
    write_result("gpu", result)
    return result


if __name__ == "__main__":
    sys.exit(0 if run(int(sys.argv[1]) if len(sys.argv) > 1 else 5) is not None else 2)
