"""What an interval's samples/s is worth: tokens/s, the TFLOP/s achieved and the model FLOPs
utilisation (MFU), from what the settings say a sample is (``monitor.tokens_per_sample``,
``monitor.flops_per_sample``) and a device's peak (``monitor.peak_tflops`` or the table).
Arithmetic on figures the interval already has: nothing is measured or synchronised."""

from __future__ import annotations

from dataclasses import dataclass

#: Dense bf16 peak TFLOP/s of one GPU (fp16 where it has no bf16), from the vendors' data
#: sheets, by a part of the name torch.cuda.get_device_name gives: the first match wins, so a
#: longer name comes before a name it contains.
PEAK_TFLOPS = (
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("A10", 125.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A40", 150.0),
    ("V100", 125.0),
)


def table_peak_tflops(device_name: str) -> float | None:
    """The table's peak for a GPU of this name; None for a device not in it (a CPU)."""
    for part, peak in PEAK_TFLOPS:
        if part in device_name:
            return peak
    return None


@dataclass(frozen=True)
class Throughput:
    """What a sample is, and the peak of the run's devices (None: not known)."""

    tokens_per_sample: float
    flops_per_sample: float
    peak_tflops_per_device: float | None
    devices: int

    def metrics(
        self, samples_per_s: float | None, counted_flops_per_s: float | None = None
    ) -> dict[str, float]:
        """The interval metrics (without ``interval/``) that ``samples_per_s`` (None: not
        known) gives; the FLOP/s are samples/s x the setting's FLOPs per sample, else those
        counted from the model over all ranks (``counted_flops_per_s``; None: not counted)."""
        found: dict[str, float] = {}
        if self.tokens_per_sample and samples_per_s is not None:
            found["tokens_per_s"] = samples_per_s * self.tokens_per_sample
        flops_per_s = counted_flops_per_s
        if self.flops_per_sample and samples_per_s is not None:
            flops_per_s = samples_per_s * self.flops_per_sample
        if flops_per_s:
            tflops = flops_per_s / 1e12
            found["tflops"] = tflops
            if self.peak_tflops_per_device:
                found["mfu_percent"] = 100.0 * tflops / (self.peak_tflops_per_device * self.devices)
        return found


def throughput(
    tokens_per_sample: float,
    flops_per_sample: float,
    peak_tflops: float,
    device_name: str | None,
    devices: int,
) -> Throughput:
    """The run's :class:`Throughput`: ``peak_tflops`` (the setting; 0: the table's figure for
    ``device_name``, a GPU's name or None on CPU) for each of ``devices``."""
    peak = peak_tflops or (table_peak_tflops(device_name) if device_name else None)
    return Throughput(tokens_per_sample, flops_per_sample, peak, devices)


def counted_flops_per_s(flops: float | None, ranks: int, seconds: float) -> float | None:
    """The FLOP/s of every rank's training forwards and backwards in an interval of
    ``seconds``, from the FLOPs counted for one rank's (None: not counted; every rank runs
    as many)."""
    if flops is None:
        return None
    return flops * ranks / max(seconds, 1e-9)


#: The interval metrics :class:`Throughput` logs: the machine's pace, not the training.
THROUGHPUT_METRICS = ("tokens_per_s", "tflops", "mfu_percent")
