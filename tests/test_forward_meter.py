"""Each rank's forward time, the slowest rank named, and the model's FLOPs counted on the
meta device: the parts with given figures and a hand-moved clock (fast tier), then 2 real
gloo ranks whose forward times come from a stand-in clock (end to end)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import inspect
import json
import logging
import random
import types
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from hpc_ddp.runtime.config import resolve_config
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.logs import LOGGER_NAME, get_logger
from hpc_ddp.runtime.loop.streams import map_tensors
from hpc_ddp.runtime.monitor.flops import flop_text, training_flops
from hpc_ddp.runtime.monitor.forward.meter import ForwardMeter
from hpc_ddp.runtime.monitor.paces import (
    INTERVALS_BEFORE_SAYING,
    IntervalPaces,
    RankTimes,
    StragglerAlarm,
    slowest_rank,
    step_time_percent,
)
from hpc_ddp.runtime.monitor.steptimers import OptimizerMeter
from hpc_ddp.runtime.monitor.throughput import counted_flops_per_s, throughput
from hpc_ddp.view.plot import plot_run
from hpc_ddp.view.runs import load_run
from hpc_ddp.view.steptime import step_time_series
from tests.helpers import HandClock, ran_on_ranks, run_with_metrics

CPU = torch.device("cpu")


def count(module: nn.Module, *args: Any, **kwargs: Any) -> int:
    return training_flops(module, args, kwargs, map_tensors, CPU)


def real_count(module: nn.Module, *args: Any) -> int:
    with FlopCounterMode(display=False) as real:
        module(*args).sum().backward()
    return int(real.get_total_flops())


class Keeper(nn.Module):
    """A model that keeps tensors on itself at its first forward (as rotary caches do), in
    an attribute and in a dict, with BatchNorm (a buffer written by forward), dropout (torch's
    random stream) and a layer drop drawn from Python's."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.norm = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8 * 6 * 6, 10)
        self.kept: torch.Tensor | None = None
        self.cache: dict[str, torch.Tensor] = {}

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.kept is None:
            self.kept = torch.ones(1, device=images.device)
            self.cache["scale"] = torch.ones(1, device=images.device)
        features = self.drop(self.norm(self.conv(images))) * self.kept * self.cache["scale"]
        if random.random() < 2.0:  # always: a layer drop would draw here
            features = features * 1.0
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
    images = torch.randn(4, 3, 8, 8)
    counted = count(Keeper(), images)
    assert counted == real_count(Keeper(), images)
    # conv forward 2*4*8*36*27, head 2*4*288*10; backward: both layers' weight gradients
    # and the conv output's gradient from the head (the images need none).
    assert counted == 2 * (2 * 4 * 8 * 36 * 27) + 3 * (2 * 4 * 288 * 10)


def test_parametrized_weights_reentrant_checkpoints_and_dataclass_inputs_are_counted() -> None:
    from torch.nn.utils.parametrizations import weight_norm
    from torch.utils.checkpoint import checkpoint

    normed = weight_norm(nn.Linear(16, 8))
    batch = torch.randn(4, 16)
    assert count(normed, batch) == real_count(weight_norm(nn.Linear(16, 8)), batch) > 0

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(16, 16)

        def forward(self, batch: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = checkpoint(self.layer, batch, use_reentrant=True)
            return out

    needing = torch.randn(4, 16, requires_grad=True)  # reentrant checkpoints need one
    assert count(Checkpointed(), needing) == real_count(Checkpointed(), needing) > 0

    @dataclasses.dataclass
    class Batch:
        images: torch.Tensor

    class TakesBatch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(16, 8)

        def forward(self, batch: Batch) -> torch.Tensor:
            out: torch.Tensor = self.layer(batch.images)
            return out

    assert count(TakesBatch(), Batch(batch)) == real_count(nn.Linear(16, 8), batch)


def test_counting_leaves_the_model_its_hooks_and_every_random_stream_as_they_were() -> None:
    torch.manual_seed(0)
    random.seed(0)
    model, images = Keeper(), torch.randn(4, 3, 8, 8)
    seen: list[torch.Tensor] = []
    model.head.register_forward_hook(lambda _module, _args, out: seen.append(out))

    class Owner:  # a script's object, bound to a hook: never copied for the count
        copies = 0

        def __deepcopy__(self, memo: dict[int, Any]) -> Owner:
            Owner.copies += 1
            return self

        def hook(self, *_: Any) -> None:
            seen.append(torch.ones(1))

    model.conv.register_forward_hook(Owner().hook)
    torchvision_like = lambda *_: seen.append(torch.ones(1))  # noqa: E731
    torchvision_like.__module__ = "torchvision.ops"
    model.norm.register_forward_hook(torchvision_like)
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    streams = (torch.get_rng_state(), random.getstate())
    count(model, images)
    assert (model.kept, model.cache) == (None, {}), "what the forward keeps stays on the copy"
    assert torch.equal(torch.get_rng_state(), streams[0]) and random.getstate() == streams[1]
    assert seen == [], "a script's hook does not see the copy's meta tensors"
    assert Owner.copies == 0
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name
        assert value.device.type == "cpu"
    assert all(parameter.grad is None for parameter in model.parameters())
    # A model whose forward kept tensors before (in an attribute and in a dict) is counted
    # on shapes: those tensors are put on the meta device, not copied where they are.
    model(images)
    assert count(model, images) == count(Keeper(), images)


class Reader(nn.Module):
    """A forward that reads a value: it cannot run on shapes alone."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        scaled: torch.Tensor = self.layer(batch) * float(batch.abs().max().item() > 0)
        return scaled


def test_the_meter_counts_once_on_the_first_training_forward(
    said: pytest.LogCaptureFixture,
) -> None:
    meter = ForwardMeter(CPU, True, map_tensors, HandClock())
    model = Keeper()
    meter.attach(model)
    with torch.no_grad():
        model.eval()
        model(torch.randn(2, 3, 8, 8))
    assert meter.flops_of(model) is None, "an evaluation forward is not a training step"
    model.train()
    model(torch.randn(4, 3, 8, 8))
    expected = count(Keeper(), torch.randn(4, 3, 8, 8))
    assert meter.flops_of(model) == expected
    model(torch.randn(4, 3, 8, 8))
    assert meter.flops_of(model) == expected
    counted = [line for line in said.messages if "kFLOP" in line]
    assert len(counted) == 1, said.messages
    assert (
        f"training forward of Keeper and its backward is {expected / 1e3:.4g} kFLOP" in (counted[0])
    )
    assert meter.take() == (0.0, 2, 2 * expected), "two training forwards, 0 s on the hand clock"
    assert meter.compute_dtype == "fp32", "the MFU's peak: the first training forward's format"


def test_the_format_of_the_first_training_forward_is_kept_for_the_mfu() -> None:
    meter = ForwardMeter(CPU, False, map_tensors, HandClock())
    model = Keeper()
    meter.attach(model)
    assert meter.compute_dtype is None, "no forward yet"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(4, 3, 8, 8))
    model(torch.randn(4, 3, 8, 8))
    assert meter.compute_dtype == "bf16"
    meter.detach()


def test_each_wrapped_model_is_counted_for_its_own_forwards() -> None:
    meter = ForwardMeter(CPU, True, map_tensors, HandClock())
    small, large = nn.Linear(8, 8), nn.Linear(8, 4096)
    meter.attach(small)
    meter.attach(large)
    batch = torch.randn(2, 8)
    small(batch)
    large(batch)
    large(batch)
    each = count(nn.Linear(8, 8), batch), count(nn.Linear(8, 4096), batch)
    assert meter.take().flops == each[0] + 2 * each[1]
    unreadable = Reader()
    meter.attach(unreadable)
    small(batch)
    unreadable(torch.randn(2, 4))
    assert meter.take() == (0.0, 2, None), "one forward not counted: no figure for the interval"
    copied = copy.deepcopy(small)  # an EMA's copy: its hooks do nothing
    copied(batch)
    assert meter.take().forwards == 0


def test_a_model_that_cannot_run_on_shapes_is_said_once_and_trains_on(
    said: pytest.LogCaptureFixture,
) -> None:
    meter = ForwardMeter(CPU, True, map_tensors, HandClock())
    model = Reader()
    meter.attach(model)
    batch = torch.randn(3, 4)
    assert torch.equal(model(batch), model.layer(batch))
    model(batch)
    assert meter.flops_of(model) is None
    failed = [line for line in said.messages if "could not be counted" in line]
    assert len(failed) == 1 and "HINT: set monitor.flops_per_sample" in failed[0], said.messages


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_model_the_meter_times_can_be_saved_whole_and_is_left_as_it_came(
    tmp_path: Path,
) -> None:
    meter = ForwardMeter(CPU, False, map_tensors, HandClock())
    model = nn.Sequential(nn.Linear(4, 4))
    meter.attach(model)
    torch.save(model, tmp_path / "whole.pt")
    assert b"hpc_ddp" not in (tmp_path / "whole.pt").read_bytes(), "loads without this package"
    loaded = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert torch.equal(loaded(torch.ones(1, 4)), model(torch.ones(1, 4)))
    assert meter.take().forwards == 1, "the loaded copy is not timed"
    assert loaded.forward.__self__ is loaded, "bound to the loaded model"
    kept = copy.deepcopy(model)  # a copy made during the run and not called in it
    meter.detach()  # at run.finish(): the models are left as they came (TorchScript needs that)
    assert "forward" not in vars(model) and "forward" not in vars(kept)
    for whole in (model, kept, loaded):
        scripted = torch.jit.script(whole)
        assert torch.equal(scripted(torch.ones(1, 4)), model(torch.ones(1, 4)))
    assert meter.take().forwards == 0
    held = weakref.ref(model)
    del model, scripted
    gc.collect()  # TorchScript's own cycles
    assert held() is None, "the meter holds no model after detach"


class Doubler(nn.Module):
    """A model of a script's own class, with a keyword argument."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, batch: torch.Tensor, *, scale: float = 2.0) -> torch.Tensor:
        doubled: torch.Tensor = self.layer(batch) * scale
        return doubled


def test_a_timed_model_keeps_torchs_fast_call_and_its_copies_are_not_timed() -> None:
    clock = HandClock()
    meter = ForwardMeter(CPU, False, map_tensors, clock)
    model = Doubler()
    signature = inspect.signature(model.forward)
    meter.attach(model)
    # No hook on the module: Module.__call__ goes straight to forward (hooks cost a small
    # model's step about a tenth of its time on a CPU).
    assert not (model._forward_pre_hooks or model._forward_hooks)
    assert not (model._backward_pre_hooks or model._backward_hooks)
    assert inspect.signature(model.forward) == signature
    batch = torch.randn(2, 4)
    assert torch.equal(model(batch, scale=3.0), model.layer(batch) * 3.0)
    assert meter.take().forwards == 1
    ema = copy.deepcopy(model)  # an EMA's copy: its own forward, bound to it, not timed
    assert getattr(ema.forward, "__self__", None) is ema
    assert inspect.signature(ema.forward) == signature
    assert torch.equal(ema(batch), model.layer(batch) * 2.0)
    assert meter.take().forwards == 0
    alone = copy.deepcopy(model.forward)  # the forward copied alone keeps its module's copy
    assert torch.equal(alone(batch), model.layer(batch) * 2.0)
    target = copy.deepcopy(model)  # a copy made during the run, then wrapped too
    meter.attach(target)
    assert torch.equal(target(batch), model.layer(batch) * 2.0)
    assert meter.take().forwards == 1
    gc.disable()  # a copy let go of is freed at once: it holds no cycle through its forward
    try:
        snapshot = weakref.ref(copy.deepcopy(model))
        assert snapshot() is None
    finally:
        gc.enable()
    # A library that wraps the forward by rebinding its function (as accelerate does) keeps
    # it timed.
    rebound = types.MethodType(getattr(model.forward, "__func__"), model)  # noqa: B009
    model.forward = functools.partial(rebound, scale=1.0)  # type: ignore[method-assign]
    assert torch.equal(model(batch), model.layer(batch))
    assert meter.take().forwards == 1
    meter.detach()
    assert getattr(model.forward, "func", None) is rebound
    model(batch)
    assert meter.take().forwards == 0, "not timed after detach, even through a wrapper"
    del model.forward
    assert getattr(model.forward, "__func__", None) is Doubler.forward


def test_a_forward_the_script_set_on_the_model_is_timed_and_given_back() -> None:
    clock = HandClock()
    meter = ForwardMeter(CPU, False, map_tensors, clock)
    model = nn.Linear(4, 4)

    def own_forward(batch: torch.Tensor) -> torch.Tensor:
        clock.now += 0.25
        return batch + 1

    model.forward = own_forward  # type: ignore[method-assign,assignment]
    meter.attach(model)
    assert torch.equal(model(torch.zeros(1, 4)), torch.ones(1, 4))
    assert meter.take() == (0.25, 1, None)
    meter.detach()
    assert model.forward is own_forward
    meter.detach()  # twice: nothing more
    assert model.forward is own_forward


class Ticking(nn.Module):
    """BatchNorm (buffers DDP broadcasts before each forward) and a forward that moves the
    hand clock."""

    def __init__(self, clock: HandClock) -> None:
        super().__init__()
        self.clock = clock
        self.norm = nn.BatchNorm1d(4)
        self.layer = nn.Linear(4, 4)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        self.clock.now += 1.5
        out: torch.Tensor = self.layer(self.norm(batch))
        return out


def test_the_module_inside_ddp_is_timed_without_ddps_own_work(one_rank: None) -> None:
    clock = HandClock()
    meter = ForwardMeter(CPU, True, map_tensors, clock)
    wrapped = nn.parallel.DistributedDataParallel(Ticking(clock))
    meter.attach(wrapped.module)
    batch = torch.randn(8, 4)
    wrapped(batch).sum().backward()
    wrapped(batch).sum().backward()
    expected = count(Ticking(HandClock()), batch)
    assert meter.take() == (3.0, 2, 2 * expected)
    assert int(wrapped.module.norm.num_batches_tracked) == 2


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


def test_the_meter_times_the_outermost_training_forward_and_a_failed_one_ends() -> None:
    clock = HandClock()
    meter = ForwardMeter(CPU, False, map_tensors, clock)
    inner = Nested(clock)
    outer = Nested(clock, inner)
    meter.attach(inner)
    meter.attach(outer)
    assert meter.attached
    outer(2.0)  # 2 s in outer, then 2 s in inner: 4 s, counted once
    inner(1.5)
    assert meter.take() == (5.5, 2, None)
    assert meter.take() == (0.0, 0, None)
    with pytest.raises(ValueError):
        outer(-1.0)
    clock.now += 100  # time after a failed forward is not forward time
    outer(3.0)
    assert meter.take() == (-1.0 + 3.0 + 3.0, 2, None)
    with torch.no_grad():  # an evaluation's forward: the evaluation's time
        outer(7.0)
    outer.eval()  # so is one in eval mode
    outer(7.0)
    assert meter.take() == (0.0, 0, None)


@pytest.mark.parametrize("model_class", [nn.Linear, Doubler], ids=["torch's", "script's"])
def test_a_compiled_model_is_not_timed_and_says_so(
    model_class: type[nn.Module], said: pytest.LogCaptureFixture
) -> None:
    meter = ForwardMeter(CPU, True, map_tensors, HandClock())
    model = model_class(4, 4) if model_class is nn.Linear else model_class()
    meter.attach(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # a graph break raises
    batch = torch.randn(2, 4)
    expected = inspect.unwrap(model.forward)(batch)
    assert torch.equal(compiled(batch), expected)
    assert meter.compiled and meter.take() == (0.0, 0, None)
    assert not meter.timing(main=True)
    assert sum("runs under torch.compile" in line for line in said.messages) == 1


def test_a_model_exported_during_the_run_is_still_timed() -> None:
    meter = ForwardMeter(CPU, False, map_tensors, HandClock())
    model = Doubler()
    meter.attach(model)
    batch = torch.randn(2, 4)
    exported = torch.export.export(model, (batch,))
    assert torch.equal(exported.module()(batch), model.layer(batch) * 2.0)
    assert not meter.compiled and meter.take().forwards == 0
    model(batch)
    assert meter.timing(main=True) and meter.take().forwards == 1


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
    assert counted.metrics(1000.0, 4e12) == {"tflops": 4.0, "mfu_percent": 2.0}
    assert counted.metrics(1000.0, None) == {}
    assert counted_flops_per_s(8e9, 4, 2.0) == 16e9, "8 GFLOP a rank, 4 ranks, 2 s"
    assert counted_flops_per_s(None, 4, 2.0) is None
    assert counted.metrics(None, 4e12) == {"tflops": 4.0, "mfu_percent": 2.0}
    given = throughput(0.0, 1e9, 0.0, None, 2)
    assert given.metrics(1000.0, 4e12) == {"tflops": 1.0}, "no peak on a CPU: no MFU"


def test_a_straggler_ratio_below_one_is_refused() -> None:
    with pytest.raises(HpcDdpError) as refused:
        resolve_config(None, ["monitor.straggler_ratio=0.9"], {}, {})
    assert "monitor.straggler_ratio" in str(refused.value)


#: A rank's program's first lines: the forward timer reads a clock that only the program moves.
STAND_IN_CLOCK = """
import os
import torch
import hpc_ddp
from hpc_ddp.runtime.monitor.forward import meter

class Clock:
    now = 0.0
    def __call__(self):
        return self.now

clock = Clock()
meter.time = type("time", (), {"perf_counter": clock})
rank = int(os.environ["RANK"])
"""

#: Two ranks whose forwards take 1 s (rank 0) and 3 s (rank 1) on a stand-in clock that
#: only the model moves (no slow GPU exists here; the times enter where the clock's would,
#: and all after them is the real path: hooks, the interval's all-reduce, the alarm).
SLOW_RANK_1 = (
    STAND_IN_CLOCK
    + """
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
)


@pytest.mark.e2e
def test_a_rank_slower_in_forward_is_named_and_the_flops_counted(tmp_path: Path) -> None:
    printed, entries = ran_on_ranks(2, tmp_path, SLOW_RANK_1)
    said = [line for line in printed.splitlines() if "is the slowest for" in line]
    assert len(said) == 1, printed[-3000:]
    # No host without the system monitor (every_s=0): the rank alone is named.
    assert "rank 1 is the slowest for 3 log intervals in a row" in said[0]
    assert "1.50x the median rank's (12 s against 8 s" in said[0]
    # Linear(64, 32) on 8 samples a rank: forward 2*8*64*32, the weights' gradient as much again:
    # 8192 per sample.
    assert "a training forward of Model and its backward is 65.54 kFLOP" in printed
    logged = [e["metrics"] for e in entries if "interval/slowest_rank" in e.get("metrics", {})]
    assert len(logged) >= 3, entries  # 16 steps, a log every 4
    for metrics in logged:
        assert metrics["interval/slowest_rank"] == 1.0
        assert metrics["interval/slowest_rank_ratio"] == 1.5
        assert metrics["interval/tflops"] == pytest.approx(
            metrics["interval/samples_per_s"] * 8192 / 1e12, rel=1e-9
        )
        assert "interval/mfu_percent" not in metrics, "no peak is known for a CPU"


def test_an_intervals_parts_are_shares_of_its_length() -> None:
    times = RankTimes(10.0, [1.0, 3.0], [2.0, 4.0], [0.5, 1.5], checkpoint_s=0.5, evaluation_s=20.0)
    assert step_time_percent(times) == {
        "forward_percent": 30.0, "optimizer_percent": 10.0, "checkpoint_percent": 5.0,
        "evaluation_percent": 100.0,
    }  # fmt: skip
    metrics, said = IntervalPaces(resolve_config(None, [], {}, {}).monitor).read(
        times, "", ["node1", "node2"]
    )
    assert metrics["data_wait_percent"] == 20.0 and metrics["data_wait_percent_max"] == 30.0
    assert metrics["slowest_rank"] == 1.0 and metrics["slowest_rank_ratio"] == 4.0 / 3.0
    assert said == [], "said only after several intervals in a row"
    agreeing = RankTimes(10.0, None, None, None, 0.0, 0.0, stop_agreement_s=[0.25, 0.75])
    assert step_time_percent(agreeing)["stop_agreement_percent"] == 5.0, "the ranks' mean"
    untimed = RankTimes(10.0, None, None, None, checkpoint_s=0.0, evaluation_s=0.0)
    metrics, said = IntervalPaces(resolve_config(None, [], {}, {}).monitor).read(untimed, "", None)
    assert metrics == {"checkpoint_percent": 0.0, "evaluation_percent": 0.0} and said == []


def test_the_plot_stacks_where_each_intervals_time_went(tmp_path: Path) -> None:
    def parts(wait: float, forward: float | None, checkpoint: float) -> dict[str, float]:
        found = {"interval/data_wait_percent": wait, "interval/checkpoint_percent": checkpoint,
                 "interval/evaluation_percent": 0.0}  # fmt: skip
        return found | ({"interval/forward_percent": forward} if forward is not None else {})

    run_dir = run_with_metrics(tmp_path, [parts(10, 30, 0), parts(5, 25, 40), parts(0, 50, 0)])
    steps, series = step_time_series(run_dir)
    assert steps == [10.0, 20.0, 30.0]
    assert series == {
        "waiting for data": [10.0, 5.0, 0.0],
        "forward": [30.0, 25.0, 50.0],
        "backward, optimizer, waits for ranks and the rest": [60.0, 30.0, 50.0],
        "checkpoint stalls": [0.0, 40.0, 0.0],
    }, "evaluation never took time: not drawn"
    run = load_run(run_dir)
    assert run is not None
    *_, panel = plot_run(run).axes
    assert panel.get_title() == "where each interval's time went (%, the ranks' mean)"
    assert [text.get_text() for text in panel.get_legend().get_texts()] == list(series)
    # The optimizer's steps timed too: the rest of the step is the backward and the waits.
    both = parts(10, 30, 0) | {"interval/optimizer_percent": 15.0}
    both |= {"interval/stop_agreement_percent": 5.0}
    assert step_time_series(run_with_metrics(tmp_path / "both", [both]))[1] == {
        "waiting for data": [10.0],
        "forward": [30.0],
        "backward, waits for ranks and the rest": [40.0],
        "optimizer": [15.0],
        "agreeing on a stop": [5.0],
    }, "the checkpoints took no time: not drawn"
    # Without the forward timed (a script's own DDP, FSDP), the step is one part.
    other = run_with_metrics(tmp_path / "other", [parts(10, None, 0)])
    assert step_time_series(other)[1] == {
        "waiting for data": [10.0], "the step": [90.0],
    }  # fmt: skip
    assert step_time_series(run_with_metrics(tmp_path / "old", [{}])) == ([], {})
    # An interval with a suspension logs its rate but not its parts: blank, not bridged.
    rate = {"interval/steps_per_s": 10.0}
    suspended = run_with_metrics(tmp_path / "suspended", [rate, parts(10, None, 0), rate])
    assert step_time_series(suspended) == (
        [20.0, 30.0],
        {"waiting for data": [10.0, 0.0], "the step": [90.0, 0.0]},
    ), "the first interval, before any parts, is left out"


def test_each_interval_is_drawn_over_the_steps_it_covers_a_lone_one_too(tmp_path: Path) -> None:
    """A short run that closed one interval (at step 10) draws it over steps 0 to 10, not as
    a line of no width; intervals after it over the steps since the one before."""
    parts = {"interval/data_wait_percent": 25.0, "interval/checkpoint_percent": 0.0,
             "interval/evaluation_percent": 0.0}  # fmt: skip
    for entries, spans in (([parts], [(0.0, 10.0)]), ([parts, parts], [(0.0, 10.0), (10.0, 20.0)])):
        run = load_run(run_with_metrics(tmp_path / str(len(entries)), entries))
        assert run is not None
        *_, panel = plot_run(run).axes
        waiting = panel.containers[0]  # the bottom band's bars: waiting for data
        drawn = [(bar.get_x(), bar.get_x() + bar.get_width()) for bar in waiting]
        assert drawn == spans
        assert [(bar.get_y(), bar.get_height()) for bar in waiting] == [(0.0, 25.0)] * len(spans)
        assert panel.get_xlim() == (0.0, spans[-1][1])


def test_a_run_that_logs_no_metric_of_its_own_still_plots_its_step_time(tmp_path: Path) -> None:
    run_dir = run_with_metrics(tmp_path, [{}, {}])
    pace = {"interval/samples_per_s": 100.0, "interval/data_wait_percent": 10.0,
            "interval/checkpoint_percent": 0.0, "interval/evaluation_percent": 0.0}  # fmt: skip
    lines = [json.dumps({"step": 10 * n, "global_step": 10 * n, "epoch": 0, "time": 1.0,
                         "metrics": pace}) for n in (1, 2)]  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    run = load_run(run_dir)
    assert run is not None
    (panel,) = plot_run(run).axes
    assert panel.get_title() == "where each interval's time went (%, the ranks' mean)"
    (run_dir / "metrics.jsonl").write_text("")
    with pytest.raises(HpcDdpError, match="has no metrics yet"):
        plot_run(run)


#: Under FSDP: two sharded blocks whose own compute takes 1 s (rank 0) and 3 s (rank 1) a
#: forward on the stand-in clock, and a pre-hook on each that moves rank 0's clock 5 s, where
#: FSDP's own pre-hook waits for the other ranks' share of the block's parameters (a rank
#: that waits for a slower one looks slowest there; the gathers themselves are real).
SLOW_RANK_1_SHARDED = (
    STAND_IN_CLOCK
    + """
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 32)
    def forward(self, batch):
        clock.now += 1.5 if rank == 1 else 0.5
        return torch.relu(self.layer(batch))

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(32, 1)
    def forward(self, batch):
        for block in self.blocks:
            batch = block(batch)
        return self.head(batch)

def waits_for_the_gather(module, args):
    clock.now += 5.0 if rank == 0 else 0.0

run = hpc_ddp.start(tracking={"enabled": False}, log_interval=4)
model = run.wrap(Model())
for block in model.blocks:
    block.register_forward_pre_hook(waits_for_the_gather, prepend=True)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
for batch in run.steps(run.train_loader(torch.randn(512, 32), batch_size=16)):
    loss = model(batch).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
run.finish()
"""
)


@pytest.mark.e2e
def test_under_fsdp_the_rank_slower_in_its_blocks_compute_is_named(tmp_path: Path) -> None:
    printed, entries = ran_on_ranks(2, tmp_path, SLOW_RANK_1_SHARDED, "dist.strategy=fsdp")
    said = [line for line in printed.splitlines() if "is the slowest for" in line]
    assert len(said) == 1, printed[-3000:]
    # 4 steps an interval, 2 blocks a step: 12 s against rank 0's 4 s, 8 s the median. Rank
    # 0's 5 s a block in the pre-hook (the gather's wait) is not its compute.
    assert "rank 1 is the slowest for 3 log intervals in a row" in said[0]
    assert "1.50x the median rank's (12 s against 8 s" in said[0]
    logged = [e["metrics"] for e in entries if "interval/slowest_rank" in e.get("metrics", {})]
    assert len(logged) >= 3, entries
    assert all(metrics["interval/slowest_rank"] == 1.0 for metrics in logged)


class SteppedByHand(torch.optim.SGD):
    """An SGD whose step takes ``seconds`` on a stand-in clock."""

    def __init__(self, params: Any, clock: HandClock, seconds: float) -> None:
        super().__init__(params, lr=0.1)
        self.clock, self.seconds = clock, seconds

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self.clock.now += self.seconds
        return super().step(closure)


class Wrapping(torch.optim.Optimizer):
    """An optimizer that steps another (as a lookahead or a scheduler-free wrapper does)."""

    def __init__(self, inner: torch.optim.Optimizer, clock: HandClock) -> None:
        super().__init__(inner.param_groups, {})
        self.inner, self.clock = inner, clock

    def step(self, closure: Any = None) -> Any:
        self.clock.now += 1.0
        return self.inner.step(closure)


def test_every_optimizers_steps_are_timed_once_and_none_after_detach() -> None:
    clock = HandClock(0.0)
    weight = torch.nn.Parameter(torch.ones(3))
    meter = OptimizerMeter(CPU, clock)
    meter.attach()
    try:
        assert meter.take() is None, "no step taken"
        plain = SteppedByHand([weight], clock, 0.25)
        for _ in range(4):
            weight.grad = torch.ones(3)
            plain.step()
        assert meter.take() == 1.0
        wrapped = Wrapping(SteppedByHand([weight], clock, 0.5), clock)
        wrapped.step()
        assert meter.take() == 1.5, "a step inside another is in its caller's time, once"
        assert meter.take() is None
    finally:
        meter.detach()
    plain.step()
    assert meter.take() is None, "not timed once detached"


#: Two ranks whose forward takes 1 µs and optimizer step 3 µs a step on a stand-in clock
#: (the shares of the interval's real length are then small, and their ratio exact).
OPTIMIZER_THREE_TIMES_FORWARD = """
import torch
import hpc_ddp
from hpc_ddp.runtime.monitor import steptimers
from hpc_ddp.runtime.monitor.forward import meter

class Clock:
    now = 0.0
    def __call__(self):
        return self.now

clock = Clock()
meter.time = steptimers.time = type("time", (), {"perf_counter": clock})

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
    def forward(self, batch):
        clock.now += 1e-6
        return self.layer(batch)

class Slow(torch.optim.SGD):
    @torch.no_grad()
    def step(self, closure=None):
        clock.now += 3e-6
        return super().step(closure)

run = hpc_ddp.start(tracking={"enabled": False}, log_interval=4)
model = run.wrap(Model())
opt = Slow(model.parameters(), lr=1e-3)
for batch in run.steps(run.train_loader(torch.randn(256, 8), batch_size=16)):
    model(batch).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
run.finish()
"""


@pytest.mark.e2e
def test_each_ranks_optimizer_steps_are_a_part_of_the_interval(tmp_path: Path) -> None:
    _printed, entries = ran_on_ranks(2, tmp_path, OPTIMIZER_THREE_TIMES_FORWARD)
    logged = [e["metrics"] for e in entries if "interval/forward_percent" in e.get("metrics", {})]
    assert len(logged) >= 3, entries  # 8 steps, a log every 4 (and the epoch's end)
    for metrics in logged:
        assert metrics["interval/optimizer_percent"] == pytest.approx(
            3 * metrics["interval/forward_percent"], rel=1e-9
        )
        assert 0 < metrics["interval/optimizer_percent"] < 100
        # The ranks agreed on a stop at every step (the real clock): a share of the interval.
        assert 0 <= metrics["interval/stop_agreement_percent"] <= 100


class TwoSeconds(nn.Module):
    """A block whose forward takes 2 s on a stand-in clock."""

    def __init__(self, clock: HandClock) -> None:
        super().__init__()
        self.layer, self.clock = nn.Linear(4, 4), clock

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        self.clock.now += 2.0
        out: torch.Tensor = torch.tanh(self.layer(batch))
        return out


def test_a_forward_recomputed_inside_the_backward_is_not_timed() -> None:
    """Activation checkpointing runs a block's forward again inside the backward (under FSDP
    the timed blocks are what scripts checkpoint): that is the backward's time."""
    clock = HandClock(0.0)
    meter = ForwardMeter(CPU, False, map_tensors, clock)
    block = TwoSeconds(clock)
    meter.attach(block)
    try:
        batch = torch.randn(3, 4, requires_grad=True)
        out = torch.utils.checkpoint.checkpoint(block, batch, use_reentrant=False)
        out.sum().backward()
        assert clock.now == 4.0, "the block ran twice: its forward and its recomputation"
        taken = meter.take()
        assert (taken.forwards, taken.seconds) == (1, 2.0)
    finally:
        meter.detach()


def test_a_step_that_raised_does_not_stop_the_timing_of_later_ones() -> None:
    clock = HandClock(0.0)
    weight = torch.nn.Parameter(torch.ones(3))
    weight.grad = torch.ones(3)
    meter = OptimizerMeter(CPU, clock)
    meter.attach()
    try:
        failing = SteppedByHand([weight], clock, 0.25)
        failing.step(closure=lambda: (_ for _ in ()).throw(RuntimeError("out of memory")))
    except RuntimeError:
        pass  # a script that catches it and goes on (torch runs no post hook then)
    try:
        meter.take()  # where the interval closes
        SteppedByHand([weight], clock, 0.5).step()
        assert meter.take() == 0.5
    finally:
        meter.detach()
