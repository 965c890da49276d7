"""The GPU benchmark's refusal without a GPU and its report section (the figures themselves
are taken on a GPU machine; a GPU cannot exist here, so the section is fed a result dict)."""

from __future__ import annotations

import subprocess
import sys

from bench.report import _gpu
from tests.helpers import REPO, clean_environ


def test_gpu_bench_without_a_gpu_says_so_and_exits_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.gpu"],
        cwd=REPO,
        env=clean_environ(CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "no CUDA GPU is visible" in result.stderr
    assert "HINT: run it on a machine with a GPU" in result.stderr


def test_gpu_section_names_the_gpu_and_takes_medians() -> None:
    section = _gpu(
        {
            "gpu": "NVIDIA H100 80GB HBM3",
            "torch": "2.13.0+cu126",
            "cuda": "12.6",
            "nccl": "2.27.3",
            "global_batch": 1024,
            "loader_workers": 4,
            "repeats": 3,
            "nccl_single": {
                "tracking": True,
                "backend": "nccl",
                "device": "cuda:0",
                "global_step": 512,
                "val_loss": 0.25,
                "val_accuracy": 0.9,
                "replicas_in_sync": True,
                "mlflow_run_id": "abc",
                "samples_per_s": 250000.0,
            },
            "overhead": {
                "gpu_bound": {
                    "hidden": [4096, 4096],
                    "raw_samples_per_s": [100000.0, 90000.0, 120000.0],
                    "hpc_ddp_samples_per_s": [99000.0, 80000.0, 130000.0],
                    "ratio": 0.99,
                }
            },
        }
    )
    assert "NVIDIA H100 80GB HBM3; torch 2.13.0+cu126, CUDA 12.6, NCCL 2.27.3" in section
    assert "backend nccl, device cuda:0, 512 steps" in section
    assert "MLflow run created" in section
    assert "| gpu_bound MLP 64-4096-4096-10 | 100,000 | 99,000 | 0.990 |" in section
