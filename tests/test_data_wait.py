"""Each rank's wait for its data: timed inside the loader's ``next``, carried with the
interval metrics (a slot per rank), and said once on rank 0 when it lasts. The fast tests
drive the arithmetic and the alarm with given seconds; the end-to-end test runs 2 local gloo
ranks where rank 1's dataset is slow to read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hpc_ddp.runtime.config import resolve_config
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.monitor.datawait import (
    INTERVALS_BEFORE_SAYING,
    DataWait,
    DataWaitAlarm,
    DataWaitShares,
    data_wait_shares,
    loader_settings,
)
from tests.helpers import run_local_program


def test_only_the_time_inside_next_is_counted_and_taking_it_starts_again() -> None:
    now = [10.0]

    def clock() -> float:
        return now[0]

    class SlowBatches:
        def __iter__(self) -> SlowBatches:
            return self

        def __next__(self) -> int:
            now[0] += 0.25  # the loader's own time
            return 1

    wait = DataWait(clock)
    batches = SlowBatches()
    assert wait.next_of(batches, None) == 1
    now[0] += 5.0  # the step, not counted
    assert wait.next_of(batches, None) == 1
    assert wait.take() == 0.5
    assert wait.take() == 0.0
    end = object()
    assert wait.next_of(iter(()), end) is end


def test_a_timed_call_counts_its_own_time_even_when_it_raises() -> None:
    """The stop agreement's exchange, timed as the data wait is."""
    now = [0.0]

    def exchange() -> tuple[bool, bool]:
        now[0] += 0.5  # waiting for the slowest rank
        return True, False

    def refused() -> None:
        now[0] += 0.25
        raise RuntimeError("a peer went away")

    agreement = DataWait(lambda: now[0])
    assert agreement.timed(exchange) == (True, False)
    with pytest.raises(RuntimeError):
        agreement.timed(refused)
    assert agreement.take() == 0.75


def test_each_ranks_share_of_the_interval_and_the_rank_that_waited_most() -> None:
    assert data_wait_shares([0.5, 3.0, 1.0, 3.0], 10.0) == DataWaitShares(18.75, 1, 30.0)
    # More waiting than the interval (rank 0's clock measured it) is the whole of it.
    assert data_wait_shares([12.0], 10.0) == DataWaitShares(100.0, 0, 100.0)
    assert data_wait_shares([0.0, 0.0], 0.0).worst_percent == 0.0


def test_the_alarm_says_once_after_intervals_in_a_row_naming_rank_and_loader() -> None:
    alarm = DataWaitAlarm(20.0)
    slow, fast = DataWaitShares(40.0, 1, 75.0), DataWaitShares(5.0, 0, 8.0)
    other = DataWaitShares(30.0, 0, 50.0)
    settings = "num_workers=0, pin_memory=False, prefetch_factor=None, persistent_workers=False"
    heard = [alarm.observe(shares, settings) for shares in [slow, slow, fast, slow, other]]
    assert heard == [None] * 5, "a fast interval, or another rank, starts the count again"
    heard = [alarm.observe(shares, settings) for shares in [slow, DataWaitShares(45.0, 1, 90.0)]]
    assert heard == [None, None]
    said = alarm.observe(slow, settings)
    assert INTERVALS_BEFORE_SAYING == 3 and said is not None
    assert said.startswith(
        "rank 1 waited for its data at least 75% of each of the last 3 log intervals (all "
        "ranks, last interval: 40%; monitor.data_wait_percent=20) (rank 0's loader has "
        "num_workers=0, "
    )
    assert "HINT: more DataLoader workers" in said
    assert [alarm.observe(slow, settings) for _ in range(5)] == [None] * 5, "said once"


def test_the_loader_settings_are_read_from_the_dataloader_behind_the_loop() -> None:
    data = DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=2, num_workers=0)

    class Wrapped:  # run.train_loader keeps its DataLoader as .loader
        loader = data

    expected = "num_workers=0, pin_memory=False, prefetch_factor=None, persistent_workers=False"
    assert loader_settings(data) == loader_settings(Wrapped()) == expected
    assert loader_settings(iter([1, 2])) == ""


@pytest.mark.parametrize("value", [0, -1, 101])
def test_a_threshold_outside_0_to_100_is_refused(value: float) -> None:
    with pytest.raises(HpcDdpError, match=r"monitor.data_wait_percent=.* is invalid"):
        resolve_config(None, [f"monitor.data_wait_percent={value}"], {}, {})


SLOW_DATA_ON_RANK_1 = """
import time
import torch
import hpc_ddp
from torch.utils.data import Dataset


class Pairs(Dataset):
    def __init__(self, slow):
        self.slow = slow

    def __len__(self):
        return 512

    def __getitem__(self, index):
        if self.slow:
            time.sleep(0.01)  # 160 ms a batch of 16, against a step of a linear model
        return torch.full((4,), float(index))


run = hpc_ddp.start(
    tracking={"enabled": False}, checkpoint={"enabled": False}, log_interval=4
)
model = run.wrap(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
loader = run.train_loader(Pairs(slow=run.rank == 1), batch_size=16)
for batch in run.steps(loader):
    loss = model(batch).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    run.log("loss", loss.detach() * len(batch), len(batch))
    if run.global_step == 24:
        break
run.finish()
"""


@pytest.mark.e2e
def test_a_rank_whose_data_is_slow_is_named_once_with_the_loaders_settings(
    tmp_path: Path,
) -> None:
    script = tmp_path / "slow_data.py"
    script.write_text(SLOW_DATA_ON_RANK_1)
    result = run_local_program(2, ["--set", f"run.output_dir={tmp_path}", str(script)])
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if "waited for its data" in line]
    assert len(said) == 1, result.stderr[-3000:]
    assert "rank 1 waited for its data" in said[0]
    assert "(rank 0's loader has num_workers=0, pin_memory=False" in said[0]
    [record] = tmp_path.glob("*/*/metrics.jsonl")
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    worst = [row["metrics"]["interval/data_wait_percent_max"] for row in rows
             if "interval/data_wait_percent_max" in row.get("metrics", {})]  # fmt: skip
    # The first interval also holds the first step's one-off costs, which a busy machine
    # may stretch past the wait: the alarm needs INTERVALS_BEFORE_SAYING in a row of the rest.
    assert sum(percent > 20.0 for percent in worst[1:]) >= INTERVALS_BEFORE_SAYING, rows


def test_the_built_in_trainer_takes_the_monitor_section_and_a_resume_may_change_it() -> None:
    from hpc_ddp.trainer.config import RESUME_SAFE_PREFIXES, load_config

    config = load_config(None, ["monitor.data_wait_percent=50"])
    assert config.runtime.monitor.data_wait_percent == 50.0
    assert "monitor." in RESUME_SAFE_PREFIXES


OWN_DATA_LOOP = """
import torch
import hpc_ddp

run = hpc_ddp.start(tracking={"enabled": False}, checkpoint={"enabled": False}, log_interval=2)
model = run.wrap(torch.nn.Linear(4, 1))
for _ in run.iterations(8):
    model(torch.ones(2, 4)).sum().backward()
    run.log("seen", 2.0, 2)
run.finish()
"""


@pytest.mark.e2e
def test_a_loop_that_loads_its_own_data_records_no_data_wait(tmp_path: Path) -> None:
    """run.iterations hands out no batches, so a 0% wait would be a reading of nothing."""
    script = tmp_path / "own_data.py"
    script.write_text(OWN_DATA_LOOP)
    result = run_local_program(1, ["--set", f"run.output_dir={tmp_path}", str(script)])
    assert result.returncode == 0, result.stderr[-3000:]
    [record] = tmp_path.glob("*/*/metrics.jsonl")
    keys = {key for line in record.read_text().splitlines()
            for key in json.loads(line).get("metrics", {})}  # fmt: skip
    assert "interval/seen" in keys and not {k for k in keys if "data_wait" in k}, keys
