"""The GPU benchmark's refusal without a GPU and its report section (the figures themselves
are taken on a GPU machine; a GPU cannot exist here, so the section is fed a result dict)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.report_gpu import gpu_section, gpu_sharded_section
from tests.helpers import REPO, clean_environ


@pytest.mark.parametrize("bench", ["bench.gpu", "bench.gpu_sharded"])
@pytest.mark.e2e
def test_gpu_bench_without_a_gpu_says_so_and_exits_2(bench: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", bench],
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
    section = gpu_section(
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


def _language_model(strategy: str, tokens_per_s: float) -> dict[str, object]:
    return {"strategy": strategy, "parameters": 1000, "global_step": 268, "val_loss": 2.5,
            "tokens_per_s": tokens_per_s, "gpu_peak_memory_gb": 2.0,
            "last_save_blocked_s": 0.75}  # fmt: skip


def test_gpu_sharded_section_compares_the_language_model_runs() -> None:
    blocked = [{"size_mb": 256, "single_file_s": 0.4, "sync_s": 1.7, "async_s": 0.1,
                "async_blocked_share": 0.06}]  # fmt: skip
    facts = {"gpu": "NVIDIA H200", "repeats": 2, "blocked": blocked}
    lm = [_language_model("ddp", 500000.0), _language_model("fsdp", 300000.0)]
    section = gpu_sharded_section({**facts, "lm": lm})
    assert "| 256 MB | 0.40 s | 1.70 s | 0.100 s | 6% |" in section
    assert "| fsdp | 300,000 | 2.5000 | 2.00 GB | 0.750 s |" in section
    assert "hooks cost 40% of the tokens/s" in section
    missing = gpu_sharded_section({**facts, "lm": None, "source": "the runs did not finish"})
    assert "no figures yet: the runs did not finish." in missing


def _scale_row(world: int) -> dict[str, object]:
    latest = {
        "process_start": 0.5,
        "entry": 2.0 + world,
        "rendezvous": 2.5 + world,
        "dist_ready": 2.6 + world,
        "control_group": 3.0 + world,
        "started": 3.1 + world,
        "training": 5.0 + world,
    }
    return {
        "rank0": {"first_step": 5.25 + world},
        "latest_rank": latest,
        "earliest_rank": latest,
        "checkpoint_save_s": {
            "replica_check": 0.01,
            "gather_state": 0.02,
            "write": 0.03,
            "barrier": 0.04,
        },
        "ending_s": {"final_checkpoint": 0.1, "summary": 0.01, "close": 0.05},
        "peak_rss_mib": 300.0,
        "open_sockets": 3 * world,
        "stop": {"checkpoint_on_disk_s": 1.5, "all_ranks_stopped_s": 2.0},
    }


def test_scale_section_splits_start_up_into_phases_that_add_up() -> None:
    from bench.report_scale import scale_section, startup_phases

    phases = startup_phases(_scale_row(4))
    assert phases == {
        "srun start": 0.5,
        "imports": 5.5,
        "rendezvous": 0.5,
        "process groups": 0.5,
        "data + model": 2.0,
        "first step": 0.25,
    }
    assert sum(phases.values()) == 9.25  # the first step, seconds after the job's start
    section = scale_section({"nodes": 2, "cores": 2, "by_world_size": {"4": _scale_row(4)}})
    assert "| 4 | 0.50 | 5.50 | 0.50 | 0.50 | 2.00 | 0.25 | 9.2 |" in section
    stop_save_end = "| 1.5 | 2.0 | 0.10 = 0.01 / 0.02 / 0.03 / 0.04 | 0.16 = 0.10 / 0.01 / 0.05 |"
    assert f"| 4 {stop_save_end} 300 | 12 |" in section


def test_one_list_names_every_benchmark_its_module_and_its_results() -> None:
    """bench/catalogue.py is the one list `make bench` runs and the README is written from:
    every module with a run() is on it once, and every results file belongs to one entry."""
    import ast

    from bench.catalogue import BENCHMARKS

    names = [benchmark.name for benchmark in BENCHMARKS]
    assert len(names) == len(set(names))
    runnable = {
        f"bench.{path.stem}"
        for path in (REPO / "bench").glob("*.py")
        if any(
            isinstance(node, ast.FunctionDef) and node.name == "run"
            for node in ast.parse(path.read_text()).body
        )
    }
    assert runnable == {benchmark.module for benchmark in BENCHMARKS}
    results = {path.stem for path in (REPO / "bench" / "results").glob("*.json")}
    assert results <= set(names), results - set(names)
