"""Each rank's share of the machine: its GPU read through NVML on a thread of its own, its
processes' CPU and memory read from /proc, carried to rank 0 with the interval metrics and
recorded as system/<host>/... metrics, with an alarm for a GPU of the job left idle.

The fast tests drive the sampler with given readings and a hand-moved clock, and read a /proc
tree written in tmp_path as well as this process's own. No GPU exists here: the end-to-end
test's ranks read a stand-in for NVML (the only mock), and everything after the reading (the
slots, the all-reduce, rank 0's metrics and warning) is the real path on 2 gloo ranks."""

from __future__ import annotations

import json
import math
import os
import re
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from hpc_ddp.runtime.config import resolve_config
from hpc_ddp.runtime.errors import EXIT_STOPPED, HpcDdpError
from hpc_ddp.runtime.monitor import system
from hpc_ddp.runtime.monitor.nvml import GpuSource, gpu_number, gpu_source, read_gpu
from hpc_ddp.runtime.monitor.system import (
    IDLE_GPUS_METRIC,
    IDLE_GPUS_TAG,
    IDLE_GPUS_TAG_CHARS,
    IdleGpuAlarm,
    Place,
    SystemMonitor,
    gpu_text,
    idle_gpus_tag,
    system_metrics,
)
from hpc_ddp.runtime.monitor.usage import (
    CPU_READ_EVERY_S,
    UNKNOWN,
    USAGE_FIELDS,
    GpuReading,
    UsageSampler,
    from_slot,
    process_cpu_s,
    process_memory_mib,
    process_tree,
    to_slot,
)
from hpc_ddp.runtime.tracking.base import default_tracking_uri
from hpc_ddp.runtime.tracking.record import read_tags_set
from hpc_ddp.view.plot import plot_run
from hpc_ddp.view.runs import load_run
from tests.helpers import HandClock, clean_environ, run_local_program, run_with_metrics

NAN = math.nan


def fields(values: tuple[float, ...]) -> dict[str, float]:
    return dict(zip(USAGE_FIELDS, values, strict=True))


def test_an_interval_holds_the_mean_utilisation_the_most_memory_and_the_cpu_share() -> None:
    clock, cpu = HandClock(100.0), [50.0]
    readings = iter([GpuReading(80.0, 1000.0, 200.0, 60.0), GpuReading(40.0, 3000.0, NAN, 70.0)])
    memory = iter([500.0, 700.0, 600.0])
    sampler = UsageSampler(
        10.0, 5.0, lambda: next(readings), lambda: cpu[0], lambda: next(memory), clock
    )
    sampler.sample()
    sampler.sample()
    clock.now += 4.0
    cpu[0] += 6.0  # 6 CPU seconds in 4 s: one and a half cores
    taken = fields(sampler.take())
    assert math.isnan(taken.pop("gpu_idle_s")), "not idle"
    assert taken == {
        "cpu_percent": 150.0, "memory_mib": 700.0, "gpu_utilization_percent": 60.0,
        "gpu_memory_mib": 3000.0, "gpu_power_w": 200.0, "gpu_temperature_c": 70.0,
    }  # fmt: skip
    # No sample in the next interval: the last reading stands; the CPU share is its own.
    clock.now += 2.0
    cpu[0] += 1.0
    again = fields(sampler.take())
    assert again["cpu_percent"] == 50.0 and again["gpu_utilization_percent"] == 40.0
    assert again["memory_mib"] == 700.0


def test_intervals_of_a_few_ms_read_the_cpu_share_over_a_second_not_in_whole_ticks() -> None:
    """Linux counts CPU time in 10 ms ticks: a log interval of 8 ms read on its own gives 0 %
    or 125 % per tick. The share is read at most once a second (CPU_READ_EVERY_S), so each
    interval's figure is within a tick a second of the truth, and the /proc files are read
    once a second, not once an interval."""
    clock, reads = HandClock(0.0), []

    def ticks_so_far() -> float:  # 1.8 cores busy, counted in whole 10 ms ticks
        reads.append(clock.now)
        return math.floor(round(clock.now * 1.8 * 100, 6)) / 100

    sampler = UsageSampler(10.0, 5.0, None, ticks_so_far, lambda: 1.0, clock)
    assert sampler.cpu_every_s == CPU_READ_EVERY_S == 1.0
    clock.now = 0.5  # start-up before the first interval ends
    shares = []
    for _ in range(500):  # 4 s of intervals 8 ms long
        shares.append(fields(sampler.take())["cpu_percent"])
        clock.now += 0.008
    assert all(abs(share - 180.0) <= 2.0 for share in shares), sorted(set(shares))
    # At construction, the first take, then once a second until the last take (at 4.49 s).
    assert reads == pytest.approx([0.0, 0.5, 1.5, 2.5, 3.5])


def test_a_gpu_is_idle_from_its_first_reading_below_the_threshold_until_one_above() -> None:
    clock = HandClock(0.0)
    utilisation = iter([50.0, 3.0, 1.0, 0.0, 90.0, 2.0])
    sampler = UsageSampler(
        10.0, 5.0, lambda: GpuReading(next(utilisation), 1.0), lambda: 0.0, lambda: 1.0, clock
    )
    idle = []
    for _ in range(6):
        sampler.sample()
        clock.now += 10.0
        idle.append(fields(sampler.take())["gpu_idle_s"])
    # Below 5 % from t=10 (taken at 20, 30, 40), busy at t=40, below again from t=50.
    assert [None if math.isnan(s) else s for s in idle] == [None, 10.0, 20.0, 30.0, None, 10.0]


def test_the_wait_before_the_first_interval_ends_is_not_idle_time() -> None:
    """Start-up, compilation and a resume's loading come before the first interval's end: a
    GPU below the threshold through them starts counting as idle only then."""
    clock = HandClock(0.0)
    sampler = UsageSampler(10.0, 5.0, lambda: GpuReading(0.0, 1.0), lambda: 0.0, lambda: 1.0, clock)
    sampler.sample()
    clock.now += 600.0  # a long first step
    assert fields(sampler.take())["gpu_idle_s"] == 0.0
    clock.now += 30.0
    sampler.sample()
    clock.now += 30.0
    assert fields(sampler.take())["gpu_idle_s"] == 60.0


def test_a_failed_reading_ends_an_idle_stretch_and_a_failing_memory_read_keeps_sampling() -> None:
    clock = HandClock(0.0)
    gpu = iter([GpuReading(0.0, 1.0), RuntimeError("Xid 79"), GpuReading(0.0, 1.0)])
    memory = iter([5.0, IndexError("a damaged smaps_rollup"), 7.0, 7.0])

    def read(values: Any) -> Any:
        value = next(values)
        if isinstance(value, Exception):
            raise value
        return value

    sampler = UsageSampler(10.0, 5.0, lambda: read(gpu), lambda: 0.0, lambda: read(memory), clock)
    sampler.take()
    sampler.sample()  # idle from t=0
    clock.now += 10.0
    sampler.sample()  # both readings fail: no evidence of idleness, nothing raised
    clock.now += 10.0
    sampler.sample()  # idle again from t=20
    clock.now += 10.0
    taken = fields(sampler.take())
    assert taken["gpu_idle_s"] == 10.0 and taken["memory_mib"] == 7.0


def test_the_all_reduce_carries_no_nan_and_a_negative_cpu_share_is_none() -> None:
    values = (12.5, NAN, 0.0, NAN)
    assert to_slot(values) == (12.5, UNKNOWN, 0.0, UNKNOWN)
    back = from_slot(list(to_slot(values)))
    assert back[0] == 12.5 and back[2] == 0.0 and math.isnan(back[1]) and math.isnan(back[3])
    cpu = iter([10.0, 8.0])  # a worker reaped between the reads: its time left the sum
    sampler = UsageSampler(10.0, 5.0, None, lambda: next(cpu), lambda: 1.0, HandClock(0.0))
    assert fields(sampler.take())["cpu_percent"] == 0.0


def test_a_reading_that_fails_is_skipped_and_without_a_gpu_the_gpu_fields_are_unknown() -> None:
    def broken() -> GpuReading:
        raise RuntimeError("NVML busy")

    for read_gpu_ in (broken, None):
        sampler = UsageSampler(10.0, 5.0, read_gpu_, lambda: 0.0, lambda: 8.0, HandClock(1.0))
        sampler.sample()
        taken = fields(sampler.take())
        assert taken["memory_mib"] == 8.0
        assert all(math.isnan(taken[name]) for name in USAGE_FIELDS if name.startswith("gpu"))


def test_the_thread_samples_until_closed() -> None:
    second = threading.Event()
    sampled: list[int] = []

    def read_memory() -> float:
        sampled.append(1)
        if len(sampled) == 2:
            second.set()
        return 1.0

    before = set(threading.enumerate())
    sampler = UsageSampler(0.001, 5.0, None, lambda: 0.0, read_memory)
    sampler.start()
    assert sampled, "start samples once before the thread"
    [thread] = [t for t in set(threading.enumerate()) - before if t.name == "hpc_ddp-usage"]
    assert thread.daemon
    assert second.wait(60), "the sampling thread never took its first sample"
    sampler.close()
    assert not thread.is_alive()


def write_process(proc: Path, pid: int, children: list[int], ticks: int, pss_kib: int | None):
    task = proc / str(pid) / "task" / str(pid)
    task.mkdir(parents=True)
    (task / "children").write_text(" ".join(map(str, children)) + " ")
    # A command with a space and a parenthesis, as a real one may have.
    stat = f"{pid} (py (worker) 1) S 1 1 1 0 -1 0 0 0 0 0 {ticks} {ticks} {ticks} {ticks} 20 0"
    (proc / str(pid) / "stat").write_text(stat)
    (proc / str(pid) / "statm").write_text("1000 256 10 1 0 100 0\n")
    if pss_kib is not None:
        (proc / str(pid) / "smaps_rollup").write_text(f"Rss: 99999 kB\nPss: {pss_kib} kB\n")


def test_a_process_and_its_workers_are_read_from_proc(tmp_path: Path) -> None:
    write_process(tmp_path, 100, [101, 102], ticks=100, pss_kib=200 * 1024)
    write_process(tmp_path, 101, [103], ticks=10, pss_kib=50 * 1024)
    write_process(tmp_path, 102, [], ticks=10, pss_kib=None)  # no PSS: its resident pages
    write_process(tmp_path, 103, [], ticks=5, pss_kib=10 * 1024)
    assert process_tree(100, tmp_path) == [100, 101, 102, 103]
    per_tick = 1 / os.sysconf("SC_CLK_TCK")
    assert process_cpu_s(100, tmp_path) == pytest.approx(4 * (100 + 10 + 10 + 5) * per_tick)
    rss_102 = 256 * os.sysconf("SC_PAGE_SIZE") / 2**20
    assert process_memory_mib(100, tmp_path) == pytest.approx(200 + 50 + 10 + rss_102)
    assert math.isnan(process_memory_mib(999, tmp_path))


def test_this_process_is_read_from_the_real_proc() -> None:
    before = process_cpu_s()
    sum(i * i for i in range(2_000_000))  # CPU time to see
    assert process_cpu_s() > before
    assert 10 < process_memory_mib() < 64 * 1024


def test_the_metrics_add_up_per_host_and_name_each_gpu_once() -> None:
    rows = [
        (150.0, 700.0, 60.0, 3000.0, 200.0, 70.0, NAN),
        (50.0, 300.0, 2.0, 100.0, NAN, NAN, 30.0),
        (25.0, NAN, NAN, NAN, NAN, NAN, NAN),
    ]
    places = [Place("node1", "0"), Place("node1", "1"), Place("node 2", None)]
    assert system_metrics(rows, places) == {
        "system/node1/cpu_percent": 200.0,
        "system/node1/memory_mib": 1000.0,
        "system/node1/gpu0/utilization_percent": 60.0,
        "system/node1/gpu0/memory_mib": 3000.0,
        "system/node1/gpu0/power_w": 200.0,
        "system/node1/gpu0/temperature_c": 70.0,
        "system/node1/gpu1/utilization_percent": 2.0,
        "system/node1/gpu1/memory_mib": 100.0,
        "system/node_2/cpu_percent": 25.0,
    }
    assert gpu_text(system_metrics(rows, places)) == ", GPU 2-60%"
    assert gpu_text({"system/a/cpu_percent": 50.0}) == ""


def test_an_idle_gpu_is_named_once_and_counted_while_it_stays_idle() -> None:
    alarm = IdleGpuAlarm(5.0, 900.0)
    places = [Place("node1", "0"), Place("node1", "1")]
    busy, idle = (0.0,) * 6 + (NAN,), (0.0,) * 6 + (960.0,)
    assert alarm.observe([busy, (0.0,) * 6 + (600.0,)], places) == (0, [])
    count, lines = alarm.observe([busy, idle], places)
    assert count == 1 and len(lines) == 1
    assert lines[0].startswith(
        "GPU 1 on node1 (rank 1) has been below monitor.idle_gpu_percent=5% for 16 min"
    )
    assert "HINT:" in lines[0]
    assert alarm.observe([busy, idle], places) == (1, []), "said once"
    assert alarm.named == "node1 GPU 1 (rank 1)", "the run's tag"
    alarm.observe([idle, idle], places)
    assert alarm.named == "node1 GPU 1 (rank 1), node1 GPU 0 (rank 0)"
    many = [Place(f"node{n:03d}", "0") for n in range(100)]
    alarm.observe([idle] * 100, many)
    assert len(alarm.named) <= IDLE_GPUS_TAG_CHARS
    assert re.search(r", node\d+ GPU 0 \(rank \d+\) and \d+ more$", alarm.named), alarm.named


def test_a_later_attempt_s_idle_gpus_are_added_to_the_earlier_attempts_tag() -> None:
    alarm = IdleGpuAlarm(5.0, 900.0, earlier="node1 GPU 1 (rank 1)")
    assert alarm.named == "node1 GPU 1 (rank 1)", "as the earlier attempts left it"
    idle = (0.0,) * 6 + (960.0,)
    alarm.observe([idle, idle], [Place("node2", "0"), Place("node1", "1")])
    assert alarm.named == "node1 GPU 1 (rank 1), node2 GPU 0 (rank 0)", "each GPU once"
    assert idle_gpus_tag("a GPU 0 (rank 0) and 3 more", ["b GPU 0 (rank 1)"]) == (
        "a GPU 0 (rank 0), b GPU 0 (rank 1) and 3 more"
    ), "the count of earlier GPUs not named is kept"
    assert idle_gpus_tag("node1 GPU 1 (rank 1)", ["node1 GPU 1 (rank 3)"]) == (
        "node1 GPU 1 (rank 1)"
    ), "a GPU another attempt numbered differently is the same GPU"
    assert idle_gpus_tag(" and 1 more", ["a GPU 0 (rank 0)"]) == "a GPU 0 (rank 0) and 1 more"
    many = [f"node{n:03d} GPU 0 (rank {n})" for n in range(100)]
    full = idle_gpus_tag("", many)
    assert len(full) <= IDLE_GPUS_TAG_CHARS and full.endswith(" more")
    later = idle_gpus_tag(full, ["node999 GPU 7 (rank 7)"])
    assert later.startswith(full.rsplit(" and ", 1)[0]) and len(later) <= IDLE_GPUS_TAG_CHARS
    assert (
        int(later.rsplit(" and ", 1)[1].split()[0])
        == int(full.rsplit(" and ", 1)[1].split()[0]) + 1
    )


def test_the_idle_gpu_is_told_once_to_the_run_s_tag_and_the_stop(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's monitor, its one GPU a stand-in (no GPU here): the interval that finds it idle
    past the limit tags the run with it and asks for the stop, once."""
    reading = GpuReading(1.0, 1000.0, 250.0, 60.0)
    monkeypatch.setattr(system, "gpu_source", lambda _device: GpuSource(lambda: reading, "3", ""))
    tags: list[tuple[str, str]] = []
    stops: list[None] = []
    settings = resolve_config(None, ["monitor.idle_after_s=60", "monitor.idle_stop=true"], {}, {})
    monitor = SystemMonitor(
        settings.monitor, torch.device("cpu"), "node1", None, True,
        lambda: stops.append(None), lambda key, value: tags.append((key, value)),
    )  # fmt: skip
    try:
        busy, idle = (0.0,) * 6 + (NAN,), (0.0,) * 6 + (120.0,)
        assert monitor.metrics([busy])[IDLE_GPUS_METRIC] == 0.0
        assert (tags, stops) == ([], [])
        assert monitor.metrics([idle])[IDLE_GPUS_METRIC] == 1.0
        assert monitor.metrics([idle])[IDLE_GPUS_METRIC] == 1.0, "still idle: counted"
        assert tags == [(IDLE_GPUS_TAG, "node1 GPU 3 (rank 0)")] and stops == [None]
    finally:
        monitor.close()


def test_without_a_gpu_or_nvml_no_reader_is_made_and_why_is_said(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu = gpu_source(torch.device("cpu"))
    assert cpu.read is None and cpu.why == "the run is on CPU"
    # A CUDA device on a machine without a driver: NVML cannot start.
    no_driver = gpu_source(torch.device("cuda", 0))
    assert no_driver.read is None and no_driver.why.startswith("NVML cannot read the GPU")
    monkeypatch.setitem(sys.modules, "pynvml", None)
    missing = gpu_source(torch.device("cuda", 0))
    assert missing.read is None and "pip install nvidia-ml-py" in missing.why


def test_a_gpu_is_numbered_by_its_device_file_not_by_what_the_task_sees() -> None:
    class NVMLError(Exception):
        pass

    def no_minor(_handle: object) -> int:
        raise NVMLError("not supported")

    # A stand-in for the pynvml module (no GPU here): inside a task that sees only its own
    # GPU, NVML's index is 0; the device file /dev/nvidia3 says which GPU of the node it is.
    fake = types.SimpleNamespace(
        NVMLError=NVMLError,
        nvmlDeviceGetIndex=lambda _h: 0,
        nvmlDeviceGetMinorNumber=lambda _h: 3,
    )
    assert gpu_number(fake, object()) == 3
    fake.nvmlDeviceGetMinorNumber = no_minor
    assert gpu_number(fake, object()) == 0, "a driver with no minor number: NVML's index"


def test_a_reading_leaves_out_what_the_driver_does_not_give() -> None:
    class NVMLError(Exception):
        pass

    def no_power(_handle: object) -> int:
        raise NVMLError("not supported")

    # A stand-in for the pynvml module (no GPU here): its calls return what a driver would.
    fake = types.SimpleNamespace(
        NVMLError=NVMLError,
        NVML_TEMPERATURE_GPU=0,
        nvmlDeviceGetUtilizationRates=lambda _h: types.SimpleNamespace(gpu=87),
        nvmlDeviceGetMemoryInfo=lambda _h: types.SimpleNamespace(used=3 * 2**30),
        nvmlDeviceGetPowerUsage=no_power,
        nvmlDeviceGetTemperature=lambda _h, _sensor: 64,
    )
    reading = read_gpu(fake, object())
    assert (reading.utilization_percent, reading.memory_mib, reading.temperature_c) == (
        87.0, 3072.0, 64.0,
    )  # fmt: skip
    assert math.isnan(reading.power_w)


@pytest.mark.parametrize(
    "override", ["monitor.idle_gpu_percent=101", "monitor.every_s=-1", "monitor.idle_after_s=nan"]
)
def test_a_bad_monitor_setting_is_refused_naming_it(override: str) -> None:
    with pytest.raises(HpcDdpError) as refused:
        resolve_config(None, [override], {}, {})
    assert override.split("=")[0] in str(refused.value)


#: Two ranks whose GPUs are stand-ins: rank 0's busy, rank 1's idle (IDLE_RANK: the other way
#: round; no GPU exists here;
#: the readings enter where NVML's would, and all after them is the real path).
IDLE_GPU_ON_RANK_1 = """
import torch
import hpc_ddp
from hpc_ddp.runtime.monitor import system, usage
from hpc_ddp.runtime.monitor.nvml import GpuSource

def stand_in(device):
    rank = int(__import__("os").environ["RANK"])
    busy = 1.0 if rank == int(__import__("os").environ.get("IDLE_RANK", "1")) else 90.0
    reading = usage.GpuReading(busy, 1000.0 + rank, 250.0, 60.0 + rank)
    return GpuSource(lambda: reading, str(rank), "")

system.gpu_source = stand_in
run = hpc_ddp.start(tracking={"enabled": False}, log_interval=4)
model = run.wrap(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
for batch in run.steps(run.train_loader(torch.randn(256, 4), batch_size=16)):
    loss = model(batch).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    run.log("loss", loss.detach() * len(batch), len(batch))
run.finish()
"""


@pytest.mark.e2e
def test_an_idle_gpu_of_the_job_is_named_once_and_every_gpu_recorded(tmp_path: Path) -> None:
    script = tmp_path / "idle_gpu.py"
    script.write_text(IDLE_GPU_ON_RANK_1)
    settings = [f"run.output_dir={tmp_path}", "monitor.idle_after_s=0", "monitor.every_s=3600"]
    result = run_local_program(2, [arg for s in settings for arg in ("--set", s)] + [str(script)])
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if "monitor.idle_gpu_percent" in line]
    assert len(said) == 1, result.stderr[-3000:]
    # Minutes on the real clock from the first idle reading to the interval that says it.
    assert re.search(r" \(rank 1\) has been below monitor.idle_gpu_percent=5% for \d+ min", said[0])
    assert "GPU 1-90%" in result.stderr, "the progress line gives the GPUs' range"
    [record] = tmp_path.glob("*/*/metrics.jsonl")
    entries = [json.loads(line) for line in record.read_text().splitlines()]
    logged = [
        entry["metrics"] for entry in entries if "system/idle_gpus" in entry.get("metrics", {})
    ]
    assert len(logged) >= 3, entries  # 16 steps, a log every 4
    [host] = {name.split("/")[1] for metrics in logged for name in metrics if "/gpu0/" in name}
    for metrics in logged:
        assert metrics["system/idle_gpus"] == 1.0
        assert metrics[f"system/{host}/gpu0/utilization_percent"] == 90.0
        assert metrics[f"system/{host}/gpu1/utilization_percent"] == 1.0
        assert metrics[f"system/{host}/gpu1/memory_mib"] == 1001.0
        assert metrics[f"system/{host}/gpu1/temperature_c"] == 61.0
        assert metrics[f"system/{host}/gpu0/power_w"] == 250.0
        # Two processes that imported torch: between a few tens of MiB and a machine's worth.
        assert 50 < metrics[f"system/{host}/memory_mib"] < 64 * 1024
        # Read in clock ticks, and the first share may span a few ms: >= 0, not > 0.
        assert math.isfinite(metrics[f"system/{host}/cpu_percent"])
        assert metrics[f"system/{host}/cpu_percent"] >= 0


@pytest.mark.e2e
def test_with_idle_stop_an_idle_gpu_stops_the_run_with_a_checkpoint_and_no_requeue(
    tmp_path: Path,
) -> None:
    script = tmp_path / "idle_gpu.py"
    script.write_text(IDLE_GPU_ON_RANK_1)
    settings = [f"run.output_dir={tmp_path}", "monitor.idle_after_s=0", "monitor.every_s=3600",
                "monitor.idle_stop=true", "preempt.check_every_steps=1"]  # fmt: skip
    result = run_local_program(2, [arg for s in settings for arg in ("--set", s)] + [str(script)])
    assert result.returncode == EXIT_STOPPED, result.stderr[-3000:]
    assert "monitor.idle_stop=true: stopping the run with a checkpoint" in result.stderr
    stopped = re.search(r"stopped at step (\d+) after a checkpoint", result.stderr)
    assert stopped, result.stderr[-3000:]
    # Said at the first interval's publication (one interval late: step 8), stopped at the
    # ranks' next agreed check, before the loader's 16 steps ran out.
    assert 8 <= int(stopped.group(1)) < 16
    [run_dir] = tmp_path.glob("*/*/checkpoints")
    assert [folder.name for folder in run_dir.iterdir() if folder.name.startswith("step-")] == [
        f"step-{int(stopped.group(1)):09d}"
    ]
    assert "the job was requeued" not in result.stderr


@pytest.mark.e2e
def test_the_gpus_each_attempt_found_idle_add_up_in_the_run_s_tag(tmp_path: Path) -> None:
    """Attempt 1 finds rank 1's GPU idle and stops (monitor.idle_stop); attempt 2 resumes
    and finds rank 0's idle: the MLflow run's tag names both, attempt 1's first."""
    script = tmp_path / "idle_gpu.py"
    script.write_text(IDLE_GPU_ON_RANK_1.replace('tracking={"enabled": False}, ', ""))
    settings = [f"run.output_dir={tmp_path}", "run.id=twice", "monitor.idle_after_s=0",
                "monitor.every_s=3600", "preempt.check_every_steps=1"]  # fmt: skip
    options = [arg for s in settings for arg in ("--set", s)]
    first = run_local_program(2, [*options, "--set", "monitor.idle_stop=true", str(script)])
    assert first.returncode == EXIT_STOPPED, first.stderr[-3000:]
    second = run_local_program(
        2, [*options, str(script)], environment={**clean_environ(), "IDLE_RANK": "0"}
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resum" in second.stderr.lower(), second.stderr[-3000:]
    host = re.search(r"GPU 0 on (\S+) \(rank 0\) has been below", second.stderr)
    assert host, second.stderr[-3000:]
    tag = f"{host[1]} GPU 1 (rank 1), {host[1]} GPU 0 (rank 0)"
    assert read_tags_set(tmp_path / "idle_gpu" / "twice") == {IDLE_GPUS_TAG: tag}
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path))
    [mlflow_run] = client.search_runs(
        [experiment.experiment_id for experiment in client.search_experiments()]
    )
    assert mlflow_run.data.tags[IDLE_GPUS_TAG] == tag


@pytest.mark.parametrize("with_gpus", [True, False])
def test_the_plot_draws_each_gpus_utilisation_or_each_hosts_cpu(
    tmp_path: Path, with_gpus: bool
) -> None:
    def at(n: int) -> dict[str, float]:
        gpus = {"system/node1/gpu0/utilization_percent": 90.0 + n,
                "system/node1/gpu1/utilization_percent": 2.0 * n} if with_gpus else {}  # fmt: skip
        return {"system/node1/cpu_percent": 150.0 + n, "system/node2/cpu_percent": 80.0, **gpus}

    run = load_run(run_with_metrics(tmp_path, [at(1), at(2), at(3)]))
    assert run is not None
    figure = plot_run(run)
    losses, usage = figure.axes
    assert [line.get_label() for line in losses.lines] == ["loss"], "no system/ metric is a curve"
    drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
             for line in usage.lines}  # fmt: skip
    if with_gpus:
        assert usage.get_title() == "GPU utilisation (%)"
        assert drawn == {"node1 GPU 0": ([10.0, 20.0, 30.0], [91.0, 92.0, 93.0]),
                         "node1 GPU 1": ([10.0, 20.0, 30.0], [2.0, 4.0, 6.0])}  # fmt: skip
    else:
        assert usage.get_title() == "CPU of each host (%, 100 = one core)"
        assert drawn == {"node1": ([10.0, 20.0, 30.0], [151.0, 152.0, 153.0]),
                         "node2": ([10.0, 20.0, 30.0], [80.0, 80.0, 80.0])}  # fmt: skip


def test_a_run_without_system_metrics_has_no_machines_panel(tmp_path: Path) -> None:
    run = load_run(run_with_metrics(tmp_path, [{}, {}]))
    assert run is not None
    assert [axes.get_title() for axes in plot_run(run).axes] == ["losses"]
