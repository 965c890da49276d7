"""The wait for DDP's gradient all-reduce at the end of the backward: reduced with the same
bits as DDP's own, each rank's wait a part of the interval, a script's own communication hook
left alone, and the plot's band."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hpc_ddp.runtime.config import resolve_config
from hpc_ddp.runtime.monitor.paces import (
    NOT_TIMED,
    IntervalPaces,
    RankTimes,
    step_time_percent,
    timed_per_rank,
)
from hpc_ddp.view.steptime import rest_label, step_time_series
from tests.helpers import ran_on_ranks, run_local_program, run_with_metrics

#: At 3 ranks a gradient times 1/3 and a gradient divided by 3 differ in the last bit for
#: about half the elements: only DDP's own multiply gives its bits. A sparse gradient
#: (the embedding's) DDP divides. The same model runs through the timed hook (run.wrap)
#: and DDP's built-in reduction (the script's own DDP) on the same batches.
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
def test_the_timed_reduction_gives_the_bits_of_ddps_own_at_3_ranks(tmp_path: Path) -> None:
    printed, entries = ran_on_ranks(3, tmp_path, SAME_BITS, "monitor.time_gradient_sync=true")
    said = sorted(re.findall(r"rank (\d): gradients equal at (\d+) of (\d+) steps", printed))
    assert said == [(str(rank), "6", "6") for rank in range(3)], printed[-3000:]
    logged = [e["metrics"] for e in entries if "interval/forward_percent" in e.get("metrics", {})]
    assert len(logged) >= 3, entries
    for metrics in logged:
        assert 0 < metrics["interval/gradient_sync_percent"] < 100


#: Each rank's wait on a stand-in clock that only the timer reads, one tick a reading:
#: 5 µs a wait on rank 0, 1 µs on rank 1, and 1 µs a forward on both (no slow peer exists
#: here; all after the readings is the real path: the hook, the slots, the all-reduce).
WAITS_ON_A_STAND_IN_CLOCK = """
import os, sys, torch, hpc_ddp
from hpc_ddp.runtime.monitor import forward, gradsync

class Ticks:
    def __init__(self, tick):
        self.now, self.tick = 0.0, tick
    def __call__(self):
        self.now += self.tick
        return self.now

rank = int(os.environ["RANK"])
forward.time = type("time", (), {"perf_counter": Ticks(1e-6)})
gradsync.time = type("time", (), {"perf_counter": Ticks(5e-6 if rank == 0 else 1e-6)})
run = hpc_ddp.start(tracking={"enabled": False}, log_interval=4)
model = run.wrap(torch.nn.Linear(8, 4))
with torch.no_grad():
    model(torch.randn(2, 8))
after_evaluation = model._get_ddp_logging_data().get("comm_hook")
sys.stderr.write(f"rank {rank}: after an evaluation, hook {after_evaluation}\\n")
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
for batch in run.steps(run.train_loader(torch.randn(256, 8), batch_size=16)):
    with torch.no_grad():
        model(batch)  # an evaluation's forward: neither timed nor registering the hook
    model(batch).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
hook = model._get_ddp_logging_data().get("comm_hook")
sys.stderr.write(f"rank {rank}: hook {hook}, forward hooks {len(model._forward_hooks)}\\n")
run.finish()
"""


@pytest.mark.e2e
def test_each_ranks_wait_for_the_gradients_is_a_part_of_the_interval(tmp_path: Path) -> None:
    printed, entries = ran_on_ranks(
        2, tmp_path, WAITS_ON_A_STAND_IN_CLOCK, "monitor.time_gradient_sync=true"
    )
    # DDP's logging data names the hook by its qualified name.
    timing_hook = "GradientSyncMeter._register_once.<locals>.reduce"
    # Registered at the first training forward, not at an evaluation's; the forward hook
    # that registered it is gone (torch's fast call path again).
    assert re.findall(r"rank \d: after an evaluation, hook (\S+)", printed) == ["None"] * 2
    assert sorted(re.findall(r"rank (\d): hook (\S+), forward hooks (\d+)", printed)) == [
        ("0", timing_hook, "0"), ("1", timing_hook, "0"),
    ], printed[-3000:]  # fmt: skip
    logged = [e["metrics"] for e in entries if "interval/forward_percent" in e.get("metrics", {})]
    assert len(logged) >= 3, entries  # 8 steps, a log every 4 (and the epoch's end)
    for metrics in logged:  # the ranks' mean: (5 + 1) / 2 µs a step, 1 µs a forward
        assert metrics["interval/gradient_sync_percent"] == pytest.approx(
            3 * metrics["interval/forward_percent"], rel=1e-9
        )


#: A script that registers its own communication hook after run.wrap, as torch's docs show.
OWN_HOOK = """
import sys, torch, hpc_ddp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

run = hpc_ddp.start(tracking={"enabled": False}, log_interval=4)
model = run.wrap(torch.nn.Linear(8, 4))
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
def test_by_default_no_hook_is_registered_and_the_wait_not_timed(tmp_path: Path) -> None:
    printed, entries = ran_on_ranks(2, tmp_path, WAITS_ON_A_STAND_IN_CLOCK)
    assert sorted(re.findall(r"rank (\d): hook (\S+), forward hooks (\d+)", printed)) == [
        ("0", "None", "0"), ("1", "None", "0"),
    ], printed[-3000:]  # fmt: skip
    logged = [e["metrics"] for e in entries if "interval/forward_percent" in e.get("metrics", {})]
    assert logged, entries
    assert not any("interval/gradient_sync_percent" in metrics for metrics in logged)


@pytest.mark.e2e
def test_a_scripts_own_communication_hook_is_kept_and_the_wait_not_timed(tmp_path: Path) -> None:
    printed, entries = ran_on_ranks(2, tmp_path, OWN_HOOK, "monitor.time_gradient_sync=true")
    said = sorted(re.findall(r"rank (\d): my hook reduced (\d+) buckets", printed))
    assert said == [("0", "16"), ("1", "16")], printed[-3000:]  # one bucket, 16 steps
    assert printed.count("the model has a communication hook of its own") == 1
    logged = [e["metrics"] for e in entries if "interval/forward_percent" in e.get("metrics", {})]
    assert logged, entries
    assert not any("interval/gradient_sync_percent" in metrics for metrics in logged)


@pytest.mark.e2e
@pytest.mark.parametrize("option", ["gradient_as_bucket_view", "batched_grad_copy"])
def test_ddp_options_that_divide_otherwise_are_refused_with_a_hint(
    tmp_path: Path, option: str
) -> None:
    script = tmp_path / "program.py"
    script.write_text(
        "import torch, hpc_ddp\n"
        "run = hpc_ddp.start(tracking={'enabled': False})\n"
        f"run.wrap(torch.nn.Linear(8, 4), {option}=True)\n"
    )
    settings = ["--set", f"run.output_dir={tmp_path}", "--set", "monitor.time_gradient_sync=true"]
    result = run_local_program(1, [*settings, str(script)])
    assert result.returncode != 0
    assert f"DistributedDataParallel({option}=True)" in result.stderr
    assert f"HINT: leave {option} out" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_a_part_no_rank_timed_is_left_out_and_a_rank_that_did_not_counts_0() -> None:
    assert timed_per_rank([NOT_TIMED, NOT_TIMED]) is None
    assert timed_per_rank([NOT_TIMED, 2.0]) == [0.0, 2.0]
    times = RankTimes(10.0, None, [1.0, 1.0], None, 0.0, 0.0, gradient_sync_s=[4.0, 0.0])
    assert step_time_percent(times) == {
        "forward_percent": 10.0, "gradient_sync_percent": 20.0, "checkpoint_percent": 0.0,
        "evaluation_percent": 0.0,
    }  # fmt: skip
    metrics, _said = IntervalPaces(resolve_config(None, [], {}, {}).monitor).read(times, "", None)
    assert metrics["gradient_sync_percent"] == 20.0


def test_the_rest_of_the_step_is_named_by_what_was_not_timed() -> None:
    assert rest_label(True, True, True) == "backward"
    assert rest_label(True, False, True) == "backward, waits for ranks"
    assert rest_label(True, False, False) == "backward, optimizer, waits for ranks"
    assert rest_label(False, False, True) == "forward, backward, waits for ranks"
    assert rest_label(False, True, False) == "forward, backward, optimizer"
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
        "backward": [35.0],
        "waiting for the gradients' all-reduce": [30.0],
        "optimizer": [10.0],
    }
