"""The CUDA path on a real GPU: NCCL, bf16, the GPU's random stream in checkpoints.

Skipped where torch sees no CUDA device (CI has none); on a GPU machine run
`pytest tests/test_gpu.py`. Nothing here is mocked: one local rank drives cuda:0 over NCCL.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from hpc_ddp.runtime.errors import EXIT_STOPPED
from hpc_ddp.runtime.monitor.throughput import ComputeDtype, table_peak_tflops
from tests.helpers import RESUMABLE as MID_EPOCH_STOPPABLE
from tests.helpers import clean_environ, read_summary, run_local, run_local_program

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (torch.cuda.is_available() is False)",
    ),
]

SMALL = ["data.num_samples=8192", "data.batch_size=128", "train.epochs=2", "tracking.enabled=false"]
#: tests/test_fault_tolerance.py's run that is stopped mid-epoch, with dropout so that the
#: GPU's random stream shapes the weights: a resume that lost it would train differently.
RESUMABLE = [*MID_EPOCH_STOPPABLE, "model.dropout=0.1", "tracking.enabled=false"]


def test_one_rank_trains_on_the_gpu_over_nccl_in_bf16(tmp_path: Path) -> None:
    result = run_local(1, tmp_path, [*SMALL, "train.precision=bf16", "run.id=bf16"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "checks passed: 1 rank(s) on 1 host(s): devices" in result.stderr, "on the GPU"
    facts = read_summary(tmp_path, "synthetic-mlp", "bf16")
    assert facts["backend"] == "nccl" and facts["device"] == "cuda:0", facts
    assert facts["global_step"] == 128 and facts["replicas_in_sync"] is True
    assert isinstance(facts["val_loss"], float) and facts["val_loss"] < 1.0, facts["val_loss"]


def stopped_and_rerun(
    tmp_path: Path, settings: list[str]
) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """An uninterrupted run, and one stopped as on the warning signal mid-epoch (step 100 of
    200: preempt.stop_at_step) and run again: the stop's step, the uninterrupted run's
    summary and the rerun's."""
    reference = run_local(1, tmp_path, [*settings, "run.id=reference"])
    assert reference.returncode == 0, reference.stderr[-3000:]
    stopping = run_local(1, tmp_path, [*settings, "run.id=interrupted", "preempt.stop_at_step=100"])
    assert stopping.returncode == EXIT_STOPPED, stopping.stderr[-3000:]
    stop_step = int(re.search(r"checkpoint \(stop signal\) step (\d+)", stopping.stderr).group(1))  # type: ignore[union-attr]
    resumed = run_local(1, tmp_path, [*settings, "run.id=interrupted"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return (
        stop_step,
        read_summary(tmp_path, "synthetic-mlp", "reference"),
        read_summary(tmp_path, "synthetic-mlp", "interrupted"),
    )


def test_a_gpu_run_stopped_mid_epoch_resumes_to_the_uninterrupted_weights(tmp_path: Path) -> None:
    stop_step, expected, actual = stopped_and_rerun(tmp_path, RESUMABLE)
    assert stop_step == 100, "at the rehearsed step, mid-epoch"
    assert actual["device"] == "cuda:0" and actual["resumed_from_step"] == stop_step
    assert actual["weights_sha256"] == expected["weights_sha256"]
    assert actual["val_loss"] == expected["val_loss"]


def test_more_local_ranks_than_gpus_is_refused_with_a_hint(tmp_path: Path) -> None:
    nproc = torch.cuda.device_count() + 1
    result = run_local(nproc, tmp_path, [*SMALL, "run.id=crowded"])
    assert result.returncode != 0
    assert f"{nproc} tasks" in result.stderr and "HINT:" in result.stderr, result.stderr[-3000:]
    assert "dist.device=cpu" in result.stderr, "the local fix: CPU ranks, or fewer of them"
    assert "Traceback" not in result.stderr


def test_fsdp_in_bf16_with_background_saves_resumes_on_the_gpu(tmp_path: Path) -> None:
    """FSDP2 on one GPU over NCCL, bf16 parameters, background saves (their own gloo group is
    not needed at one rank: a NCCL-only group would refuse them): stopped mid-epoch and run
    again, it ends with the uninterrupted run's weights."""
    fsdp = [*RESUMABLE, "dist.strategy=fsdp", "train.precision=bf16", "checkpoint.save_mode=async"]
    _stop_step, expected, actual = stopped_and_rerun(tmp_path, fsdp)
    assert actual["device"] == "cuda:0" and actual["backend"] == "nccl"
    assert actual["weights_sha256"] == expected["weights_sha256"]


def test_the_gpu_passes_its_checks_and_one_another_process_crowds_is_named() -> None:
    """The checks before the first step on a real GPU: known products in float32 and
    bfloat16, and free memory (a floor above what is free stands for another process)."""
    from hpc_ddp.runtime.place.health import device_findings

    assert device_findings(["cuda:0"], min_free=0.5) == []
    (crowded,) = device_findings(["cuda:0"], min_free=1.0)
    assert crowded.check == "gpu cuda:0"
    assert "GiB held by other processes before training" in crowded.seen
    assert crowded.expected == "at least 100% free (checks.min_free_gpu_memory)"


def test_two_deterministic_runs_of_the_language_model_end_bitwise_equal_on_the_gpu(
    tmp_path: Path,
) -> None:
    """run.deterministic=true on CUDA: bf16 autocast, dropout, and an embedding whose backward
    CUDA otherwise sums with atomics; two runs of the same command end with the same weights."""
    from tests.examples import LM, settings

    hashes = []
    for run_id in ("first", "second"):
        environment = clean_environ(**settings(
            tmp_path, run_id, "run.deterministic=true", "tracking.enabled=false"
        ))  # fmt: skip
        result = run_local_program(1, LM.command("--dropout", "0.1"), environment=environment)
        assert result.returncode == 0, result.stderr[-3000:]
        summary = read_summary(tmp_path, "lm", run_id)
        assert summary["device"] == "cuda:0", summary
        hashes.append(summary["weights_sha256"])
    assert hashes[0] == hashes[1]


def test_the_gpu_a_rank_trains_on_is_read_through_nvml_and_recorded(tmp_path: Path) -> None:
    from hpc_ddp.runtime.monitor.nvml import gpu_source

    source = gpu_source(torch.device("cuda", 0))
    assert source.read is not None, source.why
    reading = source.read()
    assert 0 <= reading.utilization_percent <= 100 and reading.memory_mib > 0, reading
    result = run_local(1, tmp_path, [*SMALL, "run.id=nvml", "monitor.every_s=0.5"])
    assert result.returncode == 0, result.stderr[-3000:]
    [record] = tmp_path.glob("*/nvml/metrics.jsonl")
    names = {name for line in record.read_text().splitlines()
             for name in json.loads(line).get("metrics", {})}  # fmt: skip
    assert any(name.endswith(f"/gpu{source.gpu_name}/utilization_percent") for name in names)
    assert "system/idle_gpus" in names


@pytest.mark.parametrize(("precision", "dtype"), [("bf16", "bf16"), ("fp32", "fp32")])
def test_the_mfu_is_against_the_gpus_peak_for_the_format_it_trains_in(
    tmp_path: Path, precision: str, dtype: ComputeDtype
) -> None:
    """train.precision=bf16 autocasts the forward: the MFU is over the GPU's bf16 peak;
    fp32 (TF32 not allowed, torch's default) over its fp32 peak."""
    name = torch.cuda.get_device_name(0)
    peak = table_peak_tflops(name, dtype)
    if peak is None:
        pytest.skip(f"{name} is not in the peak table")
    result = run_local(1, tmp_path, [*SMALL, f"train.precision={precision}", "run.id=mfu"])
    assert result.returncode == 0, result.stderr[-3000:]
    [record] = tmp_path.glob("*/mfu/metrics.jsonl")
    logged = [json.loads(line).get("metrics", {}) for line in record.read_text().splitlines()]
    intervals = [metrics for metrics in logged if "interval/tflops" in metrics]
    assert intervals, "the FLOPs were counted"
    for metrics in intervals:
        expected = 100 * metrics["interval/tflops"] / peak
        assert metrics["interval/mfu_percent"] == pytest.approx(expected, rel=1e-9)
