"""The wait for DDP's gradient all-reduce at the end of the backward: DDP's own reduction and
bits, each rank's wait a part of the interval (steps inside no_sync apart), timed with a
script's own communication hook and any DDP option, and the plot's band."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hpc_ddp.runtime.config import resolve_config
from hpc_ddp.runtime.monitor.gradsync import GradientSyncMeter
from hpc_ddp.runtime.monitor.paces import (
    NOT_TIMED,
    IntervalPaces,
    RankTimes,
    step_time_percent,
    timed_per_rank,
)
from hpc_ddp.view.runs import format_run, load_run
from hpc_ddp.view.steptime import rest_label, step_time_series, steps_split_line
from tests.helpers import ran_on_ranks, run_with_metrics

#: The timer reads the clock and changes nothing: the same model through run.wrap (timed) and
#: the script's own DDP (untimed) has the same gradients at 3 ranks, dense and sparse (the
#: embedding's), on the same batches.
SAME_BITS = """
import copy, sys, torch, hpc_ddp
from torch.nn.parallel import DistributedDataParallel

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(64, 16, sparse=True)
        self.hidden = torch.nn.Linear(16, 256)
        self.head = torch.nn.Linear(256, 4)
    def forward(self, tokens):
        return self.head(torch.tanh(self.hidden(self.embedding(tokens).mean(1))))

run = hpc_ddp.start(tracking={"enabled": False}, log_interval=2)
torch.manual_seed(0)
whole = Model()
timed = run.wrap(copy.deepcopy(whole))
own = DistributedDataParallel(whole)
run.register(model=timed, own=own)  # the script's own DDP laid out as run.wrap's
optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (timed, own)]
tokens = torch.randint(0, 64, (72, 5), generator=torch.Generator().manual_seed(1))
equal = []
for batch in run.steps(run.train_loader(tokens, batch_size=12)):
    for model, optimizer in zip((timed, own), optimizers):
        optimizer.zero_grad()
        model(batch).square().mean().backward()
    pairs = zip(timed.parameters(), own.parameters(), strict=True)
    equal.append(all(torch.equal(a.grad.to_dense(), b.grad.to_dense()) for a, b in pairs))
    for optimizer in optimizers:
        optimizer.step()
sys.stderr.write(f"rank {run.rank}: gradients equal at {sum(equal)} of {len(equal)} steps\\n")
run.finish()
"""


@pytest.mark.e2e
def test_a_timed_model_has_the_gradients_of_an_untimed_one_at_3_ranks(tmp_path: Path) -> None:
    printed, entries = ran_on_ranks(3, tmp_path, SAME_BITS, "monitor.time_gradient_sync=true")
    said = sorted(re.findall(r"rank (\d): gradients equal at (\d+) of (\d+) steps", printed))
    assert said == [(str(rank), "6", "6") for rank in range(3)], printed[-3000:]
    logged = [e["metrics"] for e in entries if "interval/forward_percent" in e.get("metrics", {})]
    assert len(logged) >= 3, entries
    for metrics in logged:
        assert 0 < metrics["interval/gradient_sync_percent"] < 100


#: Each rank's wait on a stand-in clock that only the timer reads, one tick a reading:
#: 5 µs a wait on rank 0, 1 µs on rank 1, and 1 µs a forward on both (no slow peer exists
#: here; all after the readings is the real path: the hook, autograd's callbacks, the slots,
#: the all-reduce). Each step has a micro-step inside no_sync first: its forward is timed,
#: its backward reduces nothing and is not.
WAITS_ON_A_STAND_IN_CLOCK = """
import os, sys, torch, hpc_ddp
from hpc_ddp.runtime.monitor import gradsync
from hpc_ddp.runtime.monitor.forward import meter

class Ticks:
    def __init__(self, tick):
        self.now, self.tick = 0.0, tick
    def __call__(self):
        self.now += self.tick
        return self.now

rank = int(os.environ["RANK"])
meter.time = type("time", (), {"perf_counter": Ticks(1e-6)})
gradsync.time = type("time", (), {"perf_counter": Ticks(5e-6 if rank == 0 else 1e-6)})
run = hpc_ddp.start(tracking={"enabled": False}, log_interval=4)
model = run.wrap(torch.nn.Linear(8, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
for batch in run.steps(run.train_loader(torch.randn(256, 8), batch_size=16)):
    with torch.no_grad():
        model(batch)  # an evaluation's forward: not timed
    with model.no_sync():
        model(batch[:8]).pow(2).mean().backward()
    model(batch[8:]).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
hook = model._get_ddp_logging_data().get("comm_hook")
during = len(model.module.bias._post_accumulate_grad_hooks or {})
run.finish()
after = len(model.module.bias._post_accumulate_grad_hooks or {})
sys.stderr.write(f"rank {rank}: comm hook {hook}, gradient hooks {during} then {after}\\n")
"""


@pytest.mark.e2e
def test_each_ranks_wait_for_the_gradients_is_a_part_of_the_interval(tmp_path: Path) -> None:
    printed, entries = ran_on_ranks(2, tmp_path, WAITS_ON_A_STAND_IN_CLOCK)  # on by default
    # No communication hook (DDP reduces as its own); one gradient hook, removed at the end.
    assert sorted(re.findall(r"rank (\d): comm hook (\S+), gradient hooks (\d) then (\d)",
                             printed)) == [
        ("0", "None", "1", "0"), ("1", "None", "1", "0"),
    ], printed[-3000:]  # fmt: skip
    logged = [e["metrics"] for e in entries if "interval/forward_percent" in e.get("metrics", {})]
    assert len(logged) >= 3, entries  # 8 steps, a log every 4 (and the epoch's end)
    for metrics in logged:  # the ranks' mean: (5 + 1) / 2 µs a step, 2 forwards of 1 µs
        assert metrics["interval/gradient_sync_percent"] == pytest.approx(
            1.5 * metrics["interval/forward_percent"], rel=1e-9
        )


#: A script that registers its own communication hook after run.wrap, as torch's docs show,
#: with the DDP options under which DDP divides the gradients in place.
OWN_HOOK = """
import sys, torch, hpc_ddp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

run = hpc_ddp.start(tracking={"enabled": False}, log_interval=4)
model = run.wrap(torch.nn.Linear(8, 4), gradient_as_bucket_view=True, batched_grad_copy=True)
reduced = []
def my_hook(state, bucket):
    reduced.append(bucket.index())
    return default_hooks.allreduce_hook(state, bucket)
model.register_comm_hook(None, my_hook)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
for batch in run.steps(run.train_loader(torch.randn(256, 8), batch_size=16)):
    model(batch).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
sys.stderr.write(f"rank {run.rank}: my hook reduced {len(reduced)} buckets\\n")
run.finish()
"""


@pytest.mark.e2e
def test_switched_off_no_hook_is_registered_and_the_wait_not_timed(tmp_path: Path) -> None:
    printed, entries = ran_on_ranks(
        2, tmp_path, WAITS_ON_A_STAND_IN_CLOCK, "monitor.time_gradient_sync=false"
    )
    assert sorted(re.findall(r"rank (\d): comm hook (\S+), gradient hooks (\d) then (\d)",
                             printed)) == [
        ("0", "None", "0", "0"), ("1", "None", "0", "0"),
    ], printed[-3000:]  # fmt: skip
    logged = [e["metrics"] for e in entries if "interval/forward_percent" in e.get("metrics", {})]
    assert logged, entries
    assert not any("interval/gradient_sync_percent" in metrics for metrics in logged)


@pytest.mark.e2e
def test_the_wait_is_timed_with_a_scripts_own_hook_and_any_ddp_option(tmp_path: Path) -> None:
    printed, entries = ran_on_ranks(2, tmp_path, OWN_HOOK, "monitor.time_gradient_sync=true")
    said = sorted(re.findall(r"rank (\d): my hook reduced (\d+) buckets", printed))
    assert said == [("0", "16"), ("1", "16")], printed[-3000:]  # one bucket, 16 steps
    logged = [e["metrics"] for e in entries if "interval/forward_percent" in e.get("metrics", {})]
    assert len(logged) >= 4, entries
    for metrics in logged:
        assert 0 < metrics["interval/gradient_sync_percent"] < 100


def test_a_part_no_rank_timed_is_left_out_and_the_mean_is_of_the_ranks_that_timed_it() -> None:
    assert timed_per_rank([NOT_TIMED, NOT_TIMED]) is None
    assert timed_per_rank([NOT_TIMED, 2.0, 0.0]) == [2.0, 0.0]
    sync = timed_per_rank([4.0, NOT_TIMED, 2.0])
    times = RankTimes(10.0, None, [1.0, 1.0, 1.0], None, 0.0, 0.0, gradient_sync_s=sync)
    assert step_time_percent(times) == {
        "forward_percent": 10.0, "gradient_sync_percent": 30.0, "checkpoint_percent": 0.0,
        "evaluation_percent": 0.0,
    }  # fmt: skip
    metrics, _said = IntervalPaces(resolve_config(None, [], {}, {}).monitor).read(times, "", None)
    assert metrics["gradient_sync_percent"] == 30.0


def test_the_rest_of_the_step_is_named_by_what_was_not_timed() -> None:
    assert rest_label(True, True, True) == "backward and the rest"
    assert rest_label(True, False, True) == "backward, waits for ranks and the rest"
    assert rest_label(True, False, False) == "backward, optimizer, waits for ranks and the rest"
    assert rest_label(False, False, True) == "forward, backward, waits for ranks and the rest"
    assert rest_label(False, True, False) == "forward, backward, optimizer and the rest"
    assert rest_label(False, False, False) == "the step"


def test_the_plot_draws_the_wait_for_the_gradients_after_the_backward(tmp_path: Path) -> None:
    parts = {
        "interval/data_wait_percent": 5.0, "interval/forward_percent": 20.0,
        "interval/gradient_sync_percent": 30.0, "interval/optimizer_percent": 10.0,
        "interval/checkpoint_percent": 0.0, "interval/evaluation_percent": 0.0,
    }  # fmt: skip
    steps, series = step_time_series(run_with_metrics(tmp_path, [parts]))
    assert steps == [10.0]
    assert series == {
        "waiting for data": [5.0],
        "forward": [20.0],
        "backward and the rest": [35.0],
        "waiting for the gradients' all-reduce": [30.0],
        "optimizer": [10.0],
    }


class HandedOver:
    """The meter's clock, and a communication hook whose last bucket is summed only once the
    meter has read the clock at the graph's end: the reducer then waits exactly ``wait`` on
    this clock. Read in the wrong order (after the reducer's wait), the wait reads 0."""

    def __init__(self, wait: float) -> None:
        self.now, self.wait = 0.0, wait
        self.read = threading.Event()
        self.delay = True

    def clock(self) -> float:
        self.read.set()
        return self.now

    def hook(self, _state: object, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        summed: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        if not (bucket.is_last() and self.delay):
            summed.set_result(bucket.buffer())
            return summed
        self.read.clear()

        def sum_after_the_reading() -> None:
            if self.read.wait(timeout=60):  # else the wait reads 0 and the test says so
                self.now += self.wait
            summed.set_result(bucket.buffer())

        threading.Thread(target=sum_after_the_reading, daemon=True).start()
        return summed


class FirstLayerIgnored(nn.Module):
    """Its last parameter (the first layer's, whose gradient comes last) is one DDP leaves
    alone: the reducer has heard of all of its own before that gradient arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 4)
        self.first = nn.Linear(8, 16)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            self, ["first.weight", "first.bias"]
        )

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.first(batch))
        return out


def timed_ddp(
    module: nn.Module, handed: HandedOver, meter: GradientSyncMeter, **options: Any
) -> DistributedDataParallel:
    model = DistributedDataParallel(module, bucket_cap_mb=1e-5, **options)  # a bucket each
    # DDP compares a hook's annotations to its own types: these are strings here.
    model.register_comm_hook(None, lambda state, bucket: handed.hook(state, bucket))
    meter.attach(model)
    return model


@pytest.mark.parametrize(
    ("module", "options"),
    [
        (lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), {}),
        (
            lambda: nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)),
            {"find_unused_parameters": True},
        ),
        (lambda: nn.Linear(8, 4, bias=False), {}),
        (lambda: FirstLayerIgnored(), {}),
    ],
    ids=["buckets", "find_unused", "one_parameter", "ignored_parameters"],
)
def test_the_wait_is_read_from_the_graphs_end_to_the_reducers_sums(
    one_rank: None, module: Callable[[], nn.Module], options: dict[str, Any]
) -> None:
    handed = HandedOver(5.0)
    meter = GradientSyncMeter(torch.device("cpu"), enabled=True, clock=handed.clock)
    model = timed_ddp(module(), handed, meter, **options)
    for _ in range(3):
        model(torch.randn(2, 8)).sum().backward()
    assert meter.take() == 15.0
    assert meter.take() is None  # no backward since: not timed, rather than 0


def test_a_static_graphs_first_step_and_forwards_in_no_sync_are_not_timed(one_rank: None) -> None:
    handed = HandedOver(5.0)
    meter = GradientSyncMeter(torch.device("cpu"), enabled=True, clock=handed.clock)
    model = timed_ddp(nn.Linear(8, 4), handed, meter, static_graph=True)
    handed.delay = False  # the first step: DDP reduces it all before the graph's end
    model(torch.randn(2, 8)).sum().backward()
    assert meter.take() is None
    handed.delay = True
    for _ in range(2):
        model(torch.randn(2, 8)).sum().backward()
    assert meter.take() == 10.0
    handed.delay = False
    with model.no_sync():
        out = model(torch.randn(2, 8))
    out.sum().backward()  # DDP decided at the forward: nothing reduced
    assert meter.take() is None


def test_two_models_in_one_backward_are_timed_once(one_rank: None) -> None:
    handed = HandedOver(5.0)
    meter = GradientSyncMeter(torch.device("cpu"), enabled=True, clock=handed.clock)
    first = timed_ddp(nn.Linear(8, 4), handed, meter)
    second = DistributedDataParallel(nn.Linear(4, 2), bucket_cap_mb=1e-5)
    meter.attach(second)
    (second(first(torch.randn(2, 8))).sum()).backward()
    assert meter.take() == 5.0  # one pair of readings around both reducers' waits
    meter.detach()
    assert meter.take() is None


def test_the_runs_view_says_where_the_steps_time_went_and_who_waited(tmp_path: Path) -> None:
    """`hpc-ddp runs NAME/ID`: the parts' means over the intervals that recorded them (the
    one without parts, suspended, left out), the most one rank waited for data, and the
    rank most often the slowest, from metrics.jsonl."""
    first = {
        "interval/data_wait_percent": 40.0, "interval/data_wait_percent_max": 93.0,
        "interval/forward_percent": 20.0, "interval/gradient_sync_percent": 30.0,
        "interval/checkpoint_percent": 0.0, "interval/evaluation_percent": 0.0,
        "interval/slowest_rank": 1.0, "interval/slowest_rank_ratio": 1.1,
    }  # fmt: skip
    second = {**first, "interval/data_wait_percent": 50.0, "interval/data_wait_percent_max": 91.0,
              "interval/slowest_rank_ratio": 1.15}  # fmt: skip
    third = {**second, "interval/slowest_rank": 0.0, "interval/slowest_rank_ratio": 1.05,
             "interval/optimizer_percent": 0.9}  # fmt: skip
    suspended = {"interval/samples_per_s": 10.0}
    run_dir = run_with_metrics(tmp_path, [first, second, suspended, third])
    assert steps_split_line(run_dir) == (
        "steps' time (a mean of 3 log intervals): waiting for data 47%, forward 20%, "
        "waiting for the gradients' all-reduce 30%, optimizer <1%; the most a rank waited "
        "for data: 93% of an interval; the slowest forward: rank 1 in 2 of 3 (at most 1.15x "
        "the median rank's)"
    )
    run = load_run(run_dir)
    assert run is not None and "steps' time (a mean of 3 log intervals)" in format_run(run)
    assert steps_split_line(run_with_metrics(tmp_path / "none", [suspended])) is None
