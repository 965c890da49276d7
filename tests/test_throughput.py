"""What an interval's samples/s is worth: tokens/s, TFLOP/s and MFU from the monitor settings
and a device's peak (pure arithmetic; no process is started)."""

from __future__ import annotations

import math

import pytest
import torch

from hpc_ddp.runtime.config import MonitorConfig
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.loop.position import Position
from hpc_ddp.runtime.monitor.flops import compute_dtype, dtype_in_use
from hpc_ddp.runtime.monitor.throughput import (
    ComputeDtype,
    run_tokens_per_s,
    table_peak_tflops,
    throughput,
)


def test_tokens_flops_and_mfu_follow_from_the_samples_per_second() -> None:
    # 4 ranks at 2,000 samples/s of 512 tokens, 6 x 125M parameters x 512 FLOPs a sample.
    flops = 6 * 125e6 * 512
    worth = throughput(512, flops, 0.0, "NVIDIA H100 80GB HBM3", 4).metrics(2000.0)
    assert worth["tokens_per_s"] == 1_024_000.0
    assert worth["tflops"] == pytest.approx(2000 * flops / 1e12)  # 768 TFLOP/s
    assert worth["mfu_percent"] == pytest.approx(100 * 768 / (989 * 4))


def test_a_cpu_or_an_unknown_gpu_logs_no_mfu_unless_its_peak_is_given() -> None:
    assert throughput(0, 1e9, 0.0, None, 2).metrics(100.0) == {"tflops": 0.1}
    assert "mfu_percent" not in throughput(0, 1e9, 0.0, "Some Future GPU", 2).metrics(100.0)
    given = throughput(0, 1e9, 0.5, None, 2).metrics(100.0)
    assert given["mfu_percent"] == pytest.approx(100 * 0.1 / (0.5 * 2))
    assert throughput(0, 0, 0.0, "NVIDIA A100-SXM4-80GB", 8).metrics(100.0) == {}, (
        "nothing said of a sample: nothing but samples/s"
    )


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L4", 121.0),
        ("Tesla V100-SXM2-32GB", 125.0),
    ],
)
def test_the_table_finds_a_gpu_by_the_name_torch_gives_it(name: str, peak: float) -> None:
    assert table_peak_tflops(name) == peak


@pytest.mark.parametrize(
    ("name", "dtype", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "fp8", 1979.0),
        ("NVIDIA H100 80GB HBM3", "tf32", 494.0),
        ("NVIDIA H100 80GB HBM3", "fp32", 67.0),
        ("NVIDIA A100-SXM4-80GB", "fp16", 312.0),
        ("NVIDIA A100-SXM4-80GB", "fp8", None),  # no FP8 in Ampere's tensor cores
        ("Tesla V100-SXM2-32GB", "tf32", 15.7),  # no TF32 either: fp32 as fp32
        ("Tesla V100-SXM2-32GB", "bf16", 125.0),  # no bf16: its fp16's
    ],
)
def test_the_peak_is_the_one_for_the_format_the_model_runs_in(
    name: str, dtype: ComputeDtype, peak: float | None
) -> None:
    assert table_peak_tflops(name, dtype) == peak


def test_the_mfu_follows_the_format_and_a_given_peak_holds_for_every_format() -> None:
    h100 = throughput(0, 1e9, 0.0, "NVIDIA H100 80GB HBM3", 1)
    # 494 TFLOP/s: half the bf16 peak, all of TF32's.
    assert h100.metrics(494e3, None, "bf16")["mfu_percent"] == pytest.approx(100 * 494 / 989)
    assert h100.metrics(494e3, None, "tf32")["mfu_percent"] == pytest.approx(100.0)
    assert h100.metrics(494e3, None, None) == h100.metrics(494e3, None, "bf16"), "bf16 assumed"
    given = throughput(0, 1e9, 500.0, "NVIDIA H100 80GB HBM3", 1)
    assert given.metrics(494e3, None, "tf32")["mfu_percent"] == pytest.approx(100 * 494 / 500)


@pytest.mark.parametrize(
    ("autocast", "parameters", "tf32", "expected"),
    [
        (torch.bfloat16, torch.float32, True, "bf16"),
        (torch.float16, torch.float32, False, "fp16"),
        (None, torch.float32, False, "fp32"),
        (None, torch.float32, True, "tf32"),
        (None, torch.bfloat16, True, "bf16"),
        (None, None, True, None),  # no floating-point parameter
        (None, torch.float64, False, None),  # not a format of the table
    ],
)
def test_the_format_is_autocasts_else_the_parameters(
    autocast: torch.dtype | None,
    parameters: torch.dtype | None,
    tf32: bool,
    expected: str | None,
) -> None:
    assert compute_dtype(autocast, parameters, tf32) == expected


def test_the_format_in_use_is_read_as_a_forward_starts() -> None:
    model = torch.nn.Linear(2, 2)
    assert dtype_in_use(model, "cpu") == "fp32", "TF32 is a GPU's"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dtype_in_use(model, "cpu") == "bf16"
    assert dtype_in_use(model.to(torch.bfloat16), "cpu") == "bf16"


@pytest.mark.parametrize("key", ["tokens_per_sample", "flops_per_sample", "peak_tflops"])
@pytest.mark.parametrize("value", [-1.0, math.inf, math.nan])
def test_a_throughput_setting_must_be_a_number_of_zero_or_more(key: str, value: float) -> None:
    with pytest.raises(HpcDdpError, match=f"monitor.{key}=.* is invalid: expected a number >= 0"):
        MonitorConfig(**{key: value})  # type: ignore[arg-type]


def test_the_runs_tokens_per_second_follow_from_its_samples_per_second() -> None:
    assert run_tokens_per_s(2560, 2.0, 512) == 655360.0
    assert run_tokens_per_s(1000, 3.0, 512) == 170666.7, "from the samples, rounded once"
    assert run_tokens_per_s(2560, 2.0, 0.0) is None, "what a sample is was not said"
    assert run_tokens_per_s(None, 2.0, 512) is None, "batches of no known size"


def test_the_summarys_rates_agree_whatever_the_run_lasted() -> None:
    # 12 steps of 96 in 0.21949 s: the summary states 0.219 s, and both of its rates follow
    # from that, not one from the stated time and one from the unrounded.
    summary = Position(global_step=12, train_time_s=0.21949).summary(96)
    assert summary["train_time_s"] == 0.219
    assert summary["samples_per_s"] == round(1152 / 0.219, 1)
    tokens_per_s = run_tokens_per_s(summary["samples_seen"], summary["train_time_s"], 10)
    assert tokens_per_s == pytest.approx(10 * summary["samples_per_s"], abs=0.5 + 0.05)


def test_fp32_counts_as_tf32_where_torch_lets_a_gpu_use_it() -> None:
    linear, conv = torch.nn.Linear(2, 2), torch.nn.Conv2d(1, 1, 3)
    # torch's defaults: matrix multiplies in fp32, cuDNN's convolutions in TF32.
    assert dtype_in_use(linear, "cuda") == "fp32"
    assert dtype_in_use(conv, "cuda") == "tf32"
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32"  # torch 2.9's switch: the old getters now raise
    try:
        assert dtype_in_use(linear, "cuda") == "tf32"
    finally:
        matmul.fp32_precision = before
    assert dtype_in_use(linear, "cuda") == "fp32"
