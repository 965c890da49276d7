"""A rank's own GPU read through NVML (``nvidia-ml-py``, imported only where a GPU is).

The GPU is found by its UUID, as CUDA names it, so the reading is the device this rank
trains on whatever ``CUDA_VISIBLE_DEVICES`` holds, and no other GPU of the node is read. It
is numbered by its device file's minor number (``/dev/nvidiaN``), as the node's own
``nvidia-smi`` and Slurm's gres.conf number it: inside a job whose tasks each see only their
own GPU (Slurm's device cgroups), NVML's index is 0 in every task.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from hpc_ddp.runtime.monitor.usage import GpuReading


class GpuSource(NamedTuple):
    """How to read this rank's GPU, and its number on the node (:func:`gpu_number`);
    ``read`` is None where there is nothing to read, and ``why`` says why."""

    read: Callable[[], GpuReading] | None
    gpu_index: int | None
    why: str


def gpu_source(device: torch.device) -> GpuSource:
    """The NVML reader of ``device``'s GPU (no reader on a CPU, or where NVML cannot be
    reached: the run goes on, and ``why`` says what was missing)."""
    if device.type != "cuda":
        return GpuSource(None, None, "the run is on CPU")
    try:
        import pynvml  # type: ignore[import-untyped]
    except ImportError:
        return GpuSource(None, None, "nvidia-ml-py is not installed (pip install nvidia-ml-py)")
    try:
        pynvml.nvmlInit()
        uuid = torch.cuda.get_device_properties(device).uuid
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        number = gpu_number(pynvml, handle)
    except Exception as error:  # NVMLError and friends: the run goes on
        return GpuSource(None, None, f"NVML cannot read the GPU ({error})")
    return GpuSource(lambda: read_gpu(pynvml, handle), number, "")


def gpu_number(pynvml: Any, handle: Any) -> int:
    """``handle``'s GPU's number on its node: its device file's minor number, else (a driver
    that has none to give) NVML's index."""
    try:
        return int(pynvml.nvmlDeviceGetMinorNumber(handle))
    except pynvml.NVMLError:
        return int(pynvml.nvmlDeviceGetIndex(handle))


def read_gpu(pynvml: Any, handle: Any) -> GpuReading:
    """One reading of ``handle``'s GPU; power and temperature NaN where the driver has none."""
    utilization = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    memory_mib = pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
    try:
        power_w = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
    except pynvml.NVMLError:
        power_w = math.nan
    try:
        temperature_c = float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
    except pynvml.NVMLError:
        temperature_c = math.nan
    return GpuReading(utilization, memory_mib, power_w, temperature_c)
