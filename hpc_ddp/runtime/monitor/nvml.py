"""A rank's own GPU read through NVML (``nvidia-ml-py``, imported only where a GPU is).

The GPU is found by its UUID, as CUDA names it, so the reading is the device this rank
trains on whatever ``CUDA_VISIBLE_DEVICES`` holds, and no other GPU of the node is read. It
is numbered by its device file's minor number (``/dev/nvidiaN``), as the node's own
``nvidia-smi`` and Slurm's gres.conf number it: inside a job whose tasks each see only their
own GPU (Slurm's device cgroups), NVML's index is 0 in every task.

A MIG slice is read as itself: its memory, and its GPU's temperature. NVML gives no
utilisation for a slice, and the GPU's power is shared with the other slices, so neither is
recorded; a GPU split into slices whose slice this rank holds is not known is not read.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from hpc_ddp.runtime.monitor.usage import GpuReading
from hpc_ddp.runtime.place.gpus import mig_slices


class GpuSource(NamedTuple):
    """How to read this rank's GPU, and its name on the node (:func:`gpu_number`, and for a
    MIG slice its GPU and compute instance: ``"3-mig1.0"``); ``read`` is None where there is
    nothing to read, and ``why`` says why."""

    read: Callable[[], GpuReading] | None
    gpu_name: str | None
    why: str


def gpu_source(device: torch.device, environ: Mapping[str, str] = os.environ) -> GpuSource:
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
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        return nvml_source(pynvml, uuid, environ.get("CUDA_VISIBLE_DEVICES"))
    except Exception as error:  # NVMLError and friends: the run goes on
        return GpuSource(None, None, f"NVML cannot read the GPU ({error})")


def nvml_source(pynvml: Any, cuda_uuid: str, cuda_visible_devices: str | None) -> GpuSource:
    """The reader of the device CUDA calls ``cuda_uuid``: the one MIG slice
    ``cuda_visible_devices`` names where it names one, else the GPU or slice of that UUID."""
    slices = mig_slices(cuda_visible_devices)
    if len(slices) == 1:
        handle = pynvml.nvmlDeviceGetHandleByUUID(slices[0])
    else:
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{cuda_uuid}")
        except pynvml.NVMLError:
            handle = pynvml.nvmlDeviceGetHandleByUUID(f"MIG-{cuda_uuid}")
    if _is_slice(pynvml, handle):
        gpu = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
        name = (
            f"{gpu_number(pynvml, gpu)}-mig{pynvml.nvmlDeviceGetGpuInstanceId(handle)}"
            f".{pynvml.nvmlDeviceGetComputeInstanceId(handle)}"
        )
        return GpuSource(lambda: read_slice(pynvml, handle, gpu), name, "")
    if _split_into_slices(pynvml, handle):
        return GpuSource(
            None,
            None,
            "the GPU is split into MIG slices and which one this rank holds is not known "
            "(CUDA_VISIBLE_DEVICES names none)",
        )
    return GpuSource(lambda: read_gpu(pynvml, handle), str(gpu_number(pynvml, handle)), "")


def _is_slice(pynvml: Any, handle: Any) -> bool:
    try:
        return bool(pynvml.nvmlDeviceIsMigDeviceHandle(handle))
    except pynvml.NVMLError:  # a driver from before MIG
        return False


def _split_into_slices(pynvml: Any, handle: Any) -> bool:
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError:  # a GPU without MIG
        return False
    return bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)


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
    return GpuReading(utilization, memory_mib, power_w, _temperature(pynvml, handle))


def read_slice(pynvml: Any, handle: Any, gpu: Any) -> GpuReading:
    """One reading of the MIG slice ``handle`` of ``gpu``: the slice's memory and the GPU's
    temperature (NVML gives a slice no utilisation; the GPU's power is not the slice's)."""
    memory_mib = pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
    return GpuReading(math.nan, memory_mib, math.nan, _temperature(pynvml, gpu))


def _temperature(pynvml: Any, handle: Any) -> float:
    try:
        return float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
    except pynvml.NVMLError:
        return math.nan
