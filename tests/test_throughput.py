"""What an interval's samples/s is worth: tokens/s, TFLOP/s and MFU from the monitor settings
and a device's peak (pure arithmetic; no process is started)."""

from __future__ import annotations

import math

import pytest

from hpc_ddp.runtime.config import MonitorConfig
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.monitor.throughput import table_peak_tflops, throughput


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


@pytest.mark.parametrize("key", ["tokens_per_sample", "flops_per_sample", "peak_tflops"])
@pytest.mark.parametrize("value", [-1.0, math.inf, math.nan])
def test_a_throughput_setting_must_be_a_number_of_zero_or_more(key: str, value: float) -> None:
    with pytest.raises(HpcDdpError, match=f"monitor.{key}=.* is invalid: expected a number >= 0"):
        MonitorConfig(**{key: value})  # type: ignore[arg-type]
