"""Each rank's forward time, the slowest rank named, and the model's FLOPs counted on the
meta device: the parts with given figures and a hand-moved clock (fast tier), then 2 real
gloo ranks whose forward times come from a stand-in clock (end to end)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from hpc_ddp.runtime.config import resolve_config
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.logs import LOGGER_NAME, get_logger
from hpc_ddp.runtime.loop.streams import batch_length
from hpc_ddp.runtime.monitor.forward import ForwardMeter, flop_text, training_flops
from hpc_ddp.runtime.monitor.straggler import (
    INTERVALS_BEFORE_SAYING,
    StragglerAlarm,
    slowest_rank,
)
from hpc_ddp.runtime.monitor.throughput import throughput
from tests.helpers import HandClock, run_local_program


class Keeper(nn.Module):
    """A model that keeps a tensor on itself at its first forward (as rotary caches do),
    with BatchNorm (a buffer written by forward) and dropout (a random stream)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.norm = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8 * 6 * 6, 10)
        self.kept: torch.Tensor | None = None

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.kept is None:
            self.kept = torch.ones(1, device=images.device)
        features = self.drop(self.norm(self.conv(images))) * self.kept
        logits: torch.Tensor = self.head(features.flatten(1))
        return logits


@pytest.fixture
def said(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> pytest.LogCaptureFixture:
    """What the package's logger says during the test (it keeps its lines to itself)."""
    monkeypatch.setattr(get_logger(), "propagate", True)
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    return caplog


def test_the_meta_count_equals_the_count_of_a_real_forward_and_backward() -> None:
    model, images = Keeper(), torch.randn(4, 3, 8, 8)
    counted = training_flops(model, (images,), {})
    with FlopCounterMode(display=False) as real:
        Keeper()(images).sum().backward()
    assert counted == real.get_total_flops()
    # conv forward 2*4*8*36*27, head 2*4*288*10; backward: both layers' weight gradients
    # and the conv output's gradient from the head (the images need none).
    assert counted == 2 * (2 * 4 * 8 * 36 * 27) + 3 * (2 * 4 * 288 * 10)


def test_counting_leaves_the_model_its_random_streams_and_its_batch_as_they_were() -> None:
    torch.manual_seed(0)
    model, images = Keeper(), torch.randn(4, 3, 8, 8)
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    stream = torch.get_rng_state()
    training_flops(model, (images,), {})
    assert model.kept is None, "what the forward keeps on itself stays on the copy"
    assert torch.equal(torch.get_rng_state(), stream)
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name
        assert value.device.type == "cpu"
    assert all(parameter.grad is None for parameter in model.parameters())


class Reader(nn.Module):
    """A forward that reads a value: it cannot run on shapes alone."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        scaled: torch.Tensor = self.layer(batch) * float(batch.abs().max().item() > 0)
        return scaled


def test_the_meter_counts_once_on_the_first_training_forward_per_sample(
    said: pytest.LogCaptureFixture,
) -> None:
    meter = ForwardMeter(torch.device("cpu"), True, batch_length, HandClock())
    model = Keeper()
    meter.attach(model)
    with torch.no_grad():
        model.eval()
        model(torch.randn(2, 3, 8, 8))
    assert meter.flops_per_sample is None, "an evaluation forward is not a training step"
    model.train()
    model(torch.randn(4, 3, 8, 8))
    expected = training_flops(Keeper(), (torch.randn(4, 3, 8, 8),), {}) / 4
    assert meter.flops_per_sample == expected
    model(torch.randn(8, 3, 8, 8))
    assert meter.flops_per_sample == expected
    counted = [line for line in said.messages if "kFLOP" in line]
    assert len(counted) == 1 and f"{expected / 1e3:.4g} kFLOP (counted" in counted[0], said.messages


def test_a_model_that_cannot_run_on_shapes_is_said_once_and_trains_on(
    said: pytest.LogCaptureFixture,
) -> None:
    meter = ForwardMeter(torch.device("cpu"), True, batch_length, HandClock())
    model = Reader()
    meter.attach(model)
    batch = torch.randn(3, 4)
    assert torch.equal(model(batch), model.layer(batch))
    model(batch)
    assert meter.flops_per_sample is None
    failed = [line for line in said.messages if "could not be counted" in line]
    assert len(failed) == 1 and "HINT: set monitor.flops_per_sample" in failed[0], said.messages


class Nested(nn.Module):
    """A model whose forward moves the hand clock, calls an inner wrapped model, or fails."""

    def __init__(self, clock: HandClock, inner: nn.Module | None = None) -> None:
        super().__init__()
        self.clock, self.inner = clock, inner

    def forward(self, seconds: float) -> float:
        self.clock.now += seconds
        if seconds < 0:
            raise ValueError("a failing forward")
        return self.inner(seconds) if self.inner is not None else seconds


def test_the_meter_times_the_outermost_forward_and_a_failed_one_ends_its_timing() -> None:
    clock = HandClock()
    meter = ForwardMeter(torch.device("cpu"), False, batch_length, clock)
    inner = Nested(clock)
    outer = Nested(clock, inner)
    meter.attach(inner)
    meter.attach(outer)
    assert meter.attached
    outer(2.0)  # 2 s in outer, then 2 s in inner: 4 s, counted once
    inner(1.5)
    assert meter.take() == 5.5
    assert meter.take() == 0.0
    with pytest.raises(ValueError):
        outer(-1.0)
    clock.now += 100  # time after a failed forward is not forward time
    outer(3.0)
    assert meter.take() == -1.0 + 3.0 + 3.0


def test_the_slowest_rank_against_the_median() -> None:
    slowest = slowest_rank([1.0, 3.0, 1.5, 3.0])
    assert slowest is not None
    assert (slowest.rank, slowest.seconds, slowest.median_s) == (1, 3.0, 2.25)
    assert slowest.ratio == pytest.approx(3.0 / 2.25)
    assert slowest_rank([4.0]) is None, "one rank has nobody to be slower than"
    assert slowest_rank([0.0, 0.0, 2.0]) is None, "no forward on the median rank"


def test_a_rank_slow_for_several_intervals_in_a_row_is_named_once_with_its_host() -> None:
    alarm = StragglerAlarm(1.2)
    hosts = ["node1", "node2"]
    slow = [1.0, 1.6]  # rank 1 at 1.6/1.3 = 1.23x the median
    said = [alarm.metrics(slow, hosts)[1] for _ in range(INTERVALS_BEFORE_SAYING - 1)]
    assert said == [None, None]
    assert alarm.metrics([1.0, 1.1], hosts)[1] is None  # back under the ratio: count again
    said = [alarm.metrics(slow, hosts)[1] for _ in range(INTERVALS_BEFORE_SAYING + 2)]
    assert said[: INTERVALS_BEFORE_SAYING - 1] == [None, None]
    line = said[INTERVALS_BEFORE_SAYING - 1]
    assert line is not None and line.startswith("rank 1 on node2 is the slowest for 3 log")
    assert "1.23x the median rank's (1.6 s against 1.3 s" in line and "HINT:" in line
    assert said[INTERVALS_BEFORE_SAYING:] == [None, None], "said once per rank"
    metrics, _ = alarm.metrics(slow, hosts)
    assert metrics == {"slowest_rank": 1.0, "slowest_rank_ratio": pytest.approx(1.6 / 1.3)}
    assert StragglerAlarm(1.2).metrics([2.0], None) == ({}, None)


def test_flops_are_said_with_a_prefix() -> None:
    assert [flop_text(value) for value in (512, 8192, 1.21e12, 3e16)] == [
        "512 FLOP", "8.192 kFLOP", "1.21 TFLOP", "30 PFLOP",
    ]  # fmt: skip


def test_counted_flops_give_the_tflops_and_a_setting_overrules_them() -> None:
    counted = throughput(0.0, 0.0, 100.0, None, 2)
    assert counted.metrics(1000.0, 4e9) == {"tflops": 4.0, "mfu_percent": 2.0}
    assert counted.metrics(1000.0, None) == {}
    given = throughput(0.0, 1e9, 0.0, None, 2)
    assert given.metrics(1000.0, 4e9) == {"tflops": 1.0}, "no peak on a CPU: no MFU"


def test_a_straggler_ratio_below_one_is_refused() -> None:
    with pytest.raises(HpcDdpError) as refused:
        resolve_config(None, ["monitor.straggler_ratio=0.9"], {}, {})
    assert "monitor.straggler_ratio" in str(refused.value)


#: Two ranks whose forwards take 1 s (rank 0) and 3 s (rank 1) on a stand-in clock that
#: only the model moves (no slow GPU exists here; the times enter where the clock's would,
#: and all after them is the real path: hooks, the interval's all-reduce, the alarm).
SLOW_RANK_1 = """
import os
import torch
import hpc_ddp
from hpc_ddp.runtime.monitor import forward

class Clock:
    now = 0.0
    def __call__(self):
        return self.now

clock = Clock()
forward.time = type("time", (), {"perf_counter": clock})
rank = int(os.environ["RANK"])

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(64, 32)
    def forward(self, batch):
        clock.now += 3.0 if rank == 1 else 1.0
        return self.layer(batch)

run = hpc_ddp.start(tracking={"enabled": False}, log_interval=4)
model = run.wrap(Model())
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
for batch in run.steps(run.train_loader(torch.randn(512, 64), batch_size=16)):
    loss = model(batch).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
run.finish()
"""


@pytest.mark.e2e
def test_a_rank_slower_in_forward_is_named_and_the_flops_counted(tmp_path: Path) -> None:
    script = tmp_path / "slow_rank.py"
    script.write_text(SLOW_RANK_1)
    settings = [f"run.output_dir={tmp_path}", "monitor.every_s=0"]
    result = run_local_program(2, [arg for s in settings for arg in ("--set", s)] + [str(script)])
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if "is the slowest for" in line]
    assert len(said) == 1, result.stderr[-3000:]
    # No host without the system monitor (every_s=0): the rank alone is named.
    assert "rank 1 is the slowest for 3 log intervals in a row" in said[0]
    assert "1.50x the median rank's (12 s against 8 s" in said[0]
    # Linear(64, 32) on 16 samples: forward 2*16*64*32, the weights' gradient as much again.
    assert "one sample's forward and backward is 8.192 kFLOP" in result.stderr
    [record] = tmp_path.glob("*/*/metrics.jsonl")
    entries = [json.loads(line) for line in record.read_text().splitlines()]
    logged = [e["metrics"] for e in entries if "interval/slowest_rank" in e.get("metrics", {})]
    assert len(logged) >= 3, entries  # 16 steps, a log every 4
    for metrics in logged:
        assert metrics["interval/slowest_rank"] == 1.0
        assert metrics["interval/slowest_rank_ratio"] == 1.5
        assert metrics["interval/tflops"] == pytest.approx(
            metrics["interval/samples_per_s"] * 8192 / 1e12, rel=1e-9
        )
        assert "interval/mfu_percent" not in metrics, "no peak is known for a CPU"
    assert not re.search(r"Traceback", result.stderr)
