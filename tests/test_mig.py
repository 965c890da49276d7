"""MIG slices: each rank keeps its own slice before CUDA starts, and its monitor reads that
slice (memory, its GPU's temperature), never the whole GPU.

No GPU exists here: NVML's module is a stand-in whose calls return what a driver with MIG
slices returns (the NVML reference: a slice has no utilisation, its memory is its own), and
torch's CUDA count is this CPU build's 0. All the rest is the real path.
"""

from __future__ import annotations

import math
import os
import types
from typing import Any

import pytest
import torch

from hpc_ddp.runtime.config import DistConfig, RunConfig, RuntimeConfig
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.monitor.nvml import nvml_source
from hpc_ddp.runtime.monitor.system import Place, mig_slice_names, system_metrics
from hpc_ddp.runtime.monitor.usage import USAGE_FIELDS, GpuReading, UsageSampler
from hpc_ddp.runtime.place.distenv import DistEnv
from hpc_ddp.runtime.place.gpus import check_kept_slice, cuda_indices, own_mig_slice
from hpc_ddp.runtime.session.joining import resolve_launch
from tests.helpers import HandClock

SLICES = "MIG-aaaa,MIG-bbbb"
#: torchrun's second rank of a node's two, the node's slices listed for both.
RANK_1_OF_2_SHARING_SLICES = {
    "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "CUDA_VISIBLE_DEVICES": SLICES,
    "TORCHELASTIC_RUN_ID": "mig",
}  # fmt: skip


def placed(
    local_rank: int, tasks: int, visible: str | None, per_task: int | None = None
) -> DistEnv:
    return DistEnv(
        rank=local_rank, local_rank=local_rank, world_size=tasks, local_world_size=tasks,
        node_rank=0, num_nodes=1, master_addr="127.0.0.1", master_port=29500,
        launcher="slurm", job_id="7", restart_count=0, hostname="node1",
        gpus_per_task=per_task, cuda_visible_devices=visible,
    )  # fmt: skip


def test_tasks_sharing_a_list_of_slices_each_keep_the_one_at_their_local_rank() -> None:
    assert [own_mig_slice(placed(rank, 2, SLICES)) for rank in (0, 1)] == ["MIG-aaaa", "MIG-bbbb"]
    indices, reason = cuda_indices(placed(1, 2, SLICES), visible=1)
    assert indices == [0] and "slice LOCAL_RANK (MIG-bbbb) as cuda:0" in reason
    # A task given its own slice (srun --gpus-per-task=1) keeps what it has.
    assert own_mig_slice(placed(1, 2, "MIG-bbbb", per_task=1)) is None
    assert cuda_indices(placed(1, 2, "MIG-bbbb", per_task=1), visible=1)[0] == [0]
    # Whole GPUs are placed as before.
    assert own_mig_slice(placed(1, 2, "0,1")) is None
    assert cuda_indices(placed(1, 2, "0,1"), visible=2)[0] == [1]


@pytest.mark.parametrize(
    ("visible", "gpus_per_rank", "said"),
    [
        ("MIG-aaaa,MIG-bbbb,MIG-cccc", 1, "3 MIG slices visible to each of the 2 task(s)"),
        (SLICES, 2, "dist.gpus_per_rank=2 with MIG slices"),
    ],
)
def test_slices_that_cannot_be_shared_out_one_per_rank_are_refused(
    visible: str, gpus_per_rank: int, said: str
) -> None:
    with pytest.raises(HpcDdpError) as refused:
        cuda_indices(placed(0, 2, visible), visible=1, k=gpus_per_rank)
    assert said in str(refused.value) and "HINT:" in str(refused.value)


def test_a_rank_whose_cuda_started_on_another_slice_of_the_list_is_refused() -> None:
    slices = ["MIG-aaaa", "MIG-bbbb"]
    with pytest.raises(HpcDdpError) as refused:
        check_kept_slice("MIG-bbbb", "MIG-aaaa", slices)
    assert "CUDA started before hpc_ddp.start()" in str(refused.value)
    assert "torch.cuda.is_available() starts CUDA" in str(refused.value)
    check_kept_slice("MIG-bbbb", "MIG-bbbb", slices)
    check_kept_slice("MIG-bbbb", "MIG-9999", slices)  # a UUID not of the list: nothing to tell


def test_start_narrows_cuda_visible_devices_to_the_ranks_own_slice(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    environ = RANK_1_OF_2_SHARING_SLICES
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", SLICES)
    settings = RuntimeConfig(
        dist=DistConfig(device="cuda"), run=RunConfig(output_dir=str(tmp_path), id="mig")
    )
    plan = resolve_launch(settings, "mig", environ)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "MIG-bbbb", "what CUDA reads when it starts"
    assert plan.device.devices == ("cuda:0",)
    assert "MIG-bbbb" in plan.device.reason


class NVMLError(Exception):
    pass


def stand_in_nvml(slices: dict[str, tuple[int, int]], whole_gpu_split: bool = False) -> Any:
    """NVML on a node whose GPU 3 (device file /dev/nvidia3) is split into ``slices`` (UUID
    -> GPU instance, compute instance); CUDA's UUID of the GPU itself is "gpu3"."""
    gpu = types.SimpleNamespace(name="GPU-gpu3")

    def by_uuid(uuid: str) -> Any:
        if uuid == gpu.name:
            return gpu
        if uuid in slices:
            return types.SimpleNamespace(name=uuid)
        raise NVMLError("Not Found")

    def mig_mode(handle: Any) -> list[int]:
        if handle is not gpu:
            raise NVMLError("Not Supported")
        return [1 if whole_gpu_split else 0, 0]

    return types.SimpleNamespace(
        NVMLError=NVMLError,
        NVML_TEMPERATURE_GPU=0,
        NVML_DEVICE_MIG_ENABLE=1,
        nvmlDeviceGetHandleByUUID=by_uuid,
        nvmlDeviceIsMigDeviceHandle=lambda handle: handle is not gpu,
        nvmlDeviceGetMigMode=mig_mode,
        nvmlDeviceGetDeviceHandleFromMigDeviceHandle=lambda _slice: gpu,
        nvmlDeviceGetGpuInstanceId=lambda handle: slices[handle.name][0],
        nvmlDeviceGetComputeInstanceId=lambda handle: slices[handle.name][1],
        nvmlDeviceGetMinorNumber=lambda handle: 3 if handle is gpu else 99,
        nvmlDeviceGetUtilizationRates=lambda handle: types.SimpleNamespace(gpu=77),
        nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(
            used=(40 if handle is gpu else 5) * 2**30
        ),
        nvmlDeviceGetPowerUsage=lambda handle: 300_000,
        nvmlDeviceGetTemperature=lambda handle, _sensor: 61 if handle is gpu else 99,
    )


def test_a_slice_named_by_cuda_visible_devices_is_read_as_itself() -> None:
    nvml = stand_in_nvml({"MIG-aaaa": (1, 0), "MIG-bbbb": (2, 0)})
    source = nvml_source(nvml, "whatever-cuda-says", "MIG-bbbb")
    assert source.gpu_name == "3-mig2.0" and source.read is not None
    reading = source.read()
    assert reading.memory_mib == 5 * 1024, "the slice's memory, not the GPU's 40 GiB"
    assert reading.temperature_c == 61.0, "the GPU's temperature"
    assert math.isnan(reading.utilization_percent), "NVML gives a slice none"
    assert math.isnan(reading.power_w), "the GPU's power is shared with the other slices"


def test_a_slice_is_found_by_cudas_uuid_where_cuda_visible_devices_names_none() -> None:
    nvml = stand_in_nvml({"MIG-aaaa": (1, 0)})
    assert nvml_source(nvml, "aaaa", None).gpu_name == "3-mig1.0"
    whole = nvml_source(stand_in_nvml({}), "gpu3", "0")
    assert whole.gpu_name == "3" and whole.read is not None
    assert whole.read() == GpuReading(77.0, 40 * 1024, 300.0, 61.0)


def test_a_gpu_split_into_slices_is_not_read_where_the_ranks_slice_is_not_known() -> None:
    # CUDA gave the GPU's own UUID and CUDA_VISIBLE_DEVICES names no slice: reading the GPU
    # would read the other jobs' slices.
    source = nvml_source(stand_in_nvml({"MIG-aaaa": (1, 0)}, whole_gpu_split=True), "gpu3", "0")
    assert source.read is None and source.gpu_name is None
    assert "split into MIG slices" in source.why


def test_a_slice_without_utilisation_is_never_counted_idle() -> None:
    clock = HandClock(0.0)
    reading = GpuReading(math.nan, 5120.0, math.nan, 61.0)
    sampler = UsageSampler(10.0, 5.0, lambda: reading, lambda: 0.0, lambda: 1.0, clock)
    for _ in range(3):
        sampler.sample()
        clock.now += 600.0
        taken = dict(zip(USAGE_FIELDS, sampler.take(), strict=True))
        assert math.isnan(taken["gpu_idle_s"]), "no utilisation is no evidence of idleness"
    assert taken["gpu_memory_mib"] == 5120.0


def test_two_slices_of_one_gpu_are_recorded_apart() -> None:
    row = (10.0, 100.0, math.nan, 5120.0, math.nan, 61.0, math.nan)
    places = [Place("node1", "3-mig1.0"), Place("node1", "3-mig2.0")]
    metrics = system_metrics([row, row], places)
    assert metrics["system/node1/gpu3-mig1.0/memory_mib"] == 5120.0
    assert metrics["system/node1/gpu3-mig2.0/temperature_c"] == 61.0
    assert not any(name.endswith("utilization_percent") for name in metrics)
    assert mig_slice_names([*places, Place("node2", "0")]) == (
        "node1 GPU 3-mig1.0, node1 GPU 3-mig2.0"
    )


def test_a_rank_whose_cuda_shows_another_slice_of_the_list_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # A GPU stands in: CUDA counts one device, the first slice of the list (a script that
    # started CUDA before hpc_ddp.start()), or the rank's own.
    environ = RANK_1_OF_2_SHARING_SLICES
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", SLICES)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    settings = RuntimeConfig(
        dist=DistConfig(device="cuda"), run=RunConfig(output_dir=str(tmp_path), id="mig")
    )
    shown = types.SimpleNamespace(uuid="aaaa")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _index: shown)
    with pytest.raises(HpcDdpError) as refused:
        resolve_launch(settings, "mig", environ)
    assert "to drive MIG slice MIG-bbbb" in str(refused.value)
    assert "CUDA shows MIG-aaaa" in str(refused.value)
    shown.uuid = "bbbb"
    assert resolve_launch(settings, "mig", environ).device.devices == ("cuda:0",)
