"""What an interval's samples/s is worth: tokens/s, the TFLOP/s achieved and the model FLOPs
utilisation (MFU), from what the settings say a sample is (``monitor.tokens_per_sample``,
``monitor.flops_per_sample``) and a device's peak (``monitor.peak_tflops`` or the table).
Arithmetic on figures the interval already has: nothing is measured or synchronised."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

#: The number formats of a training's matrix multiplies, as the peak table names them.
ComputeDtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8"]
#: The format assumed where the run's is not known (a script's own FLOPs per sample).
ASSUMED_DTYPE: ComputeDtype = "bf16"

_DENSE = ("fp32", "tf32", "bf16", "fp16", "fp8")
#: Dense (no sparsity) peak TFLOP/s of one GPU per format, from the vendors' data sheets, by
#: whole words of the name torch.cuda.get_device_name gives ("NVIDIA A100-SXM4-80GB" is an
#: A100, "NVIDIA RTX A1000" is not): the first match wins, so a longer name comes before a
#: name it begins with. A GPU without TF32 (V100) multiplies fp32 as fp32.
#: Hopper's figures, the same for the SXM parts (H100, H200, GH200) and for the NVL cards.
_HOPPER_SXM = (67.0, 494.0, 989.0, 989.0, 1979.0)
_HOPPER_NVL = (60.0, 418.0, 835.0, 835.0, 1671.0)
PEAK_TFLOPS: tuple[tuple[str, Mapping[str, float]], ...] = tuple(
    (part, {dtype: peak for dtype, peak in zip(_DENSE, peaks, strict=True) if peak})
    for part, peaks in (
        ("GH200", _HOPPER_SXM),
        ("H200 NVL", _HOPPER_NVL),
        ("H200", _HOPPER_SXM),
        ("H100 NVL", _HOPPER_NVL),
        ("H100 PCIe", (51.0, 378.0, 756.0, 756.0, 1513.0)),
        ("H100", _HOPPER_SXM),
        ("A100", (19.5, 156.0, 312.0, 312.0, 0.0)),
        ("A10", (31.2, 62.5, 125.0, 125.0, 0.0)),
        ("L40S", (91.6, 183.0, 362.0, 362.0, 733.0)),
        ("L40", (90.5, 90.5, 181.0, 181.0, 362.0)),
        ("L4", (30.3, 60.0, 121.0, 121.0, 242.0)),
        ("A40", (37.4, 74.8, 150.0, 150.0, 0.0)),
        ("V100", (15.7, 15.7, 0.0, 125.0, 0.0)),
    )
)


def table_peak_tflops(device_name: str, dtype: ComputeDtype = ASSUMED_DTYPE) -> float | None:
    """The table's dense peak for a GPU of this name in ``dtype`` (bf16 on a GPU without it:
    its fp16's); None for a device or a format not in it (a CPU)."""
    for part, peaks in PEAK_TFLOPS:
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(part)}(?![A-Za-z0-9])", device_name):
            return peaks.get(dtype) or (peaks.get("fp16") if dtype == "bf16" else None)
    return None


@dataclass(frozen=True)
class Throughput:
    """What a sample is, and what the run's devices are (for their peak)."""

    tokens_per_sample: float
    flops_per_sample: float
    #: monitor.peak_tflops: one device's peak, whatever the format (0: the table's).
    peak_tflops_setting: float
    #: The GPU's name as torch gives it (None: a CPU).
    device_name: str | None
    devices: int

    def peak_tflops_per_device(self, dtype: ComputeDtype | None = None) -> float | None:
        """One device's peak for ``dtype`` (None: the format is not known, bf16 assumed):
        the setting, else the table's; None where neither knows it."""
        if self.peak_tflops_setting:
            return self.peak_tflops_setting
        if self.device_name is None:
            return None
        return table_peak_tflops(self.device_name, dtype or ASSUMED_DTYPE)

    def metrics(
        self,
        samples_per_s: float | None,
        counted_flops_per_s: float | None = None,
        dtype: ComputeDtype | None = None,
    ) -> dict[str, float]:
        """The interval metrics (without ``interval/``) that ``samples_per_s`` (None: not
        known) gives; the FLOP/s are samples/s x the setting's FLOPs per sample, else those
        counted from the model over all ranks (``counted_flops_per_s``; None: not counted);
        the MFU is against the peak for ``dtype``, the format the model's forward ran in."""
        found: dict[str, float] = {}
        if self.tokens_per_sample and samples_per_s is not None:
            found["tokens_per_s"] = samples_per_s * self.tokens_per_sample
        flops_per_s = counted_flops_per_s
        if self.flops_per_sample and samples_per_s is not None:
            flops_per_s = samples_per_s * self.flops_per_sample
        if flops_per_s:
            tflops = flops_per_s / 1e12
            found["tflops"] = tflops
            peak = self.peak_tflops_per_device(dtype)
            if peak:
                found["mfu_percent"] = 100.0 * tflops / (peak * self.devices)
        return found

    def rates(
        self,
        steps_per_s: float,
        global_batch: int,
        counted_flops_per_s: float | None,
        dtype: ComputeDtype | None = None,
    ) -> tuple[str, dict[str, float]]:
        """An interval's rate for the progress line, and its ``interval/`` metrics:
        samples/s (with what they are worth: tokens/s, TFLOP/s, MFU against the peak for
        ``dtype``) over a ``global_batch`` of known size, else steps/s."""
        if not global_batch:  # a user's batches of no known size
            found = {"steps_per_s": steps_per_s, **self.metrics(None, counted_flops_per_s, dtype)}
            return f"{steps_per_s:,.2f} steps/s", {f"interval/{k}": v for k, v in found.items()}
        samples_per_s = steps_per_s * global_batch
        found = {
            "samples_per_s": samples_per_s,
            **self.metrics(samples_per_s, counted_flops_per_s, dtype),
        }
        rate = f"{samples_per_s:,.0f} samples/s"
        if "tokens_per_s" in found:
            rate += f", {found['tokens_per_s']:,.0f} tokens/s"
        return rate, {f"interval/{name}": value for name, value in found.items()}


def run_tokens_per_s(
    samples: int | None, train_time_s: float, tokens_per_sample: float
) -> float | None:
    """The run's tokens/s (its summary's) from the samples it trained on (None: not known)
    in ``train_time_s`` and ``monitor.tokens_per_sample`` (0: not said, None)."""
    if samples is None or not tokens_per_sample:
        return None
    return round(samples * tokens_per_sample / max(1e-9, train_time_s), 1)


def throughput(
    tokens_per_sample: float,
    flops_per_sample: float,
    peak_tflops: float,
    device_name: str | None,
    devices: int,
) -> Throughput:
    """The run's :class:`Throughput`: ``peak_tflops`` (the setting; 0: the table's figure for
    ``device_name``, a GPU's name or None on CPU) for each of ``devices``."""
    return Throughput(tokens_per_sample, flops_per_sample, peak_tflops, device_name, devices)


def counted_flops_per_s(flops: float | None, ranks: int, seconds: float) -> float | None:
    """The FLOP/s of every rank's training forwards and backwards in an interval of
    ``seconds``, from the FLOPs counted for one rank's (None: not counted; every rank runs
    as many)."""
    if flops is None:
        return None
    return flops * ranks / max(seconds, 1e-9)


#: The interval metrics :class:`Throughput` logs: the machine's pace, not the training.
THROUGHPUT_METRICS = ("tokens_per_s", "tflops", "mfu_percent")
