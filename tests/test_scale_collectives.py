"""The cross-rank helpers whose messages stay small at any world size, on a real 3-rank gloo
group, and the pure parts of the timeline."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import TCPStore  # type: ignore[attr-defined]
from torch.multiprocessing.spawn import spawn

from hpc_ddp.launch.local import free_loopback_port
from hpc_ddp.runtime.checkpoint.files import FORMAT_VERSION, load_checkpoint, saved_world_size
from hpc_ddp.runtime.checkpoint.state import restore_rng, rng_state
from hpc_ddp.runtime.loop.replicas import Divergence, diverged_replicas
from hpc_ddp.runtime.monitor.timeline import (
    durations,
    process_resources,
    process_start_unix,
    rank_spread,
    this_process_start_unix,
)
from hpc_ddp.runtime.place.dist import gather_object_to_main
from hpc_ddp.runtime.place.limits import open_files_needed
from hpc_ddp.runtime.tracking.record import read_tracked_run_id
from tests.helpers import REPO

WORLD = 3


def _rank(rank: int, port: int, results: Any) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    first, second = torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(first, second)
    in_sync = diverged_replicas(model, WORLD, None)
    with torch.no_grad():
        if rank == 1:
            second.bias.add_(1.0)  # rank 1: a late entry
        if rank == 2:
            first.weight.mul_(2.0)  # rank 2: the first entry
    apart = diverged_replicas(model, WORLD, None)
    gathered = gather_object_to_main({"rank": rank}, None)
    spread = rank_spread({"entry_unix": 100.0 + rank, "training_unix": 200.0 - rank}, None)
    results.put((rank, in_sync, apart, gathered, spread))
    dist.destroy_process_group()


#: When this module was imported: after its process started.
IMPORTED_UNIX = time.time()


@pytest.mark.e2e
def test_replica_check_rng_gather_and_spread_on_three_ranks() -> None:
    results = mp.get_context("spawn").SimpleQueue()
    spawn(_rank, args=(free_loopback_port(), results), nprocs=WORLD)
    by_rank = {row[0]: row[1:] for row in (results.get() for _ in range(WORLD))}
    for rank, (in_sync, apart, gathered, spread) in by_rank.items():
        assert in_sync is None
        # Two ranks differ; the lowest is named with its first differing entry.
        assert apart == Divergence(ranks=2, first_rank=1, first_entry="1.bias"), rank
        # Only rank 0 receives the gathered objects.
        assert gathered == ([{"rank": 0}, {"rank": 1}, {"rank": 2}] if rank == 0 else [])
        assert spread == {
            "earliest": {"entry_unix": 100.0, "training_unix": 198.0},
            "latest": {"entry_unix": 102.0, "training_unix": 200.0},
        }


def test_process_start_is_read_from_proc_stat() -> None:
    # A process name with spaces and parentheses must not shift the fields.
    stat = "4242 (my (odd) name) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 250 19 20"
    # Started 2.5 s after boot; now is 10 s after boot, Unix time 5000.
    assert process_start_unix(stat, 5_000.0, 10.0, 100) == pytest.approx(4_992.5)
    started = this_process_start_unix()
    # Before this module was imported (at collection), and not long before: however long
    # the tests before this one ran.
    assert started is not None and started <= IMPORTED_UNIX and IMPORTED_UNIX - started < 3600


def test_durations_and_resources() -> None:
    assert durations({"a": 1.0, "b": 1.5, "c": 4.0}, 4.25) == {"a": 0.5, "b": 2.5, "c": 0.25}
    facts = process_resources()
    assert facts["peak_rss_mib"] > 10 and facts["open_sockets"] >= 0


def test_a_resume_finds_the_mlflow_run_in_tracking_json(tmp_path: Path) -> None:
    assert read_tracked_run_id(tmp_path) is None
    (tmp_path / "tracking.json").write_text('{"run_id": null}')
    assert read_tracked_run_id(tmp_path) is None
    (tmp_path / "tracking.json").write_text('{"run_id": "abc123", "uri": "sqlite:///x"}')
    assert read_tracked_run_id(tmp_path) == "abc123"


def _with_limits(soft: int, hard: int, code: str) -> subprocess.CompletedProcess[str]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=limit,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
    )


@pytest.mark.e2e
def test_the_open_file_limit_is_raised_for_the_world_size() -> None:
    # Rank 0 of 4,096 ranks: the store's 4,096 clients and a peer per gloo group.
    assert open_files_needed(4096, is_main=True) == 3 * 4096 + 256
    assert open_files_needed(4096, is_main=False) == 2 * 4095 + 1 + 256
    code = (
        "from hpc_ddp.runtime.place.limits import raise_open_file_limit as r; import resource;"
        "print(r(5000), resource.getrlimit(resource.RLIMIT_NOFILE))"
    )
    result = _with_limits(1024, 8192, code)
    assert result.stdout.split() == ["(5000,", "8192,", "True)", "(5000,", "8192)"], result.stderr
    result = _with_limits(1024, 2048, code)
    assert result.stdout.split() == ["(2048,", "2048,", "False)", "(2048,", "2048)"], result.stderr


@pytest.mark.e2e
def test_a_hard_limit_below_the_need_is_a_warning_with_a_hint(tmp_path: Path) -> None:
    code = (
        "import sys; from hpc_ddp.cli import main; sys.argv = ['hpc-ddp', 'local', '--nproc', "
        f"'2', '--config', 'configs/synthetic.yaml', 'run.output_dir={tmp_path}', "
        "'data.num_samples=512', 'train.epochs=1', 'tracking.enabled=false', "
        "'model.hidden_sizes=[8]']; sys.exit(main())"
    )
    result = _with_limits(200, 200, code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "the open-file limit is 200 (hard limit 200), but rank 0 of 2 ranks" in result.stderr
    assert "HINT: raise it before the job starts (`ulimit -n 262`" in result.stderr


def _bytes_read() -> int:
    line = next(x for x in Path("/proc/self/io").read_text().splitlines() if x.startswith("rchar"))
    return int(line.split()[1])


def test_a_checkpoint_is_mapped_so_a_rank_reads_only_what_it_uses(tmp_path: Path) -> None:
    """Four ranks' 20 MB random states: loading reads none of them, using one reads it
    through the mapping; without mmap every rank would read all four (80 MB)."""
    streams = [{"torch": torch.full((20_000_000,), rank, dtype=torch.uint8)} for rank in range(4)]
    path = tmp_path / "step-000000001.pt"
    torch.save({"format": FORMAT_VERSION, "rng": streams, "world_size": 4}, path)
    before = _bytes_read()
    saved = load_checkpoint(path)
    assert _bytes_read() - before < 5_000_000
    assert int(saved["rng"][2]["torch"][-1]) == 2 and saved_world_size(saved) == 4


def test_python_random_state_survives_the_tensor_form() -> None:
    import random

    random.seed(7)
    state = rng_state(torch.device("cpu"))
    assert isinstance(state["python"][1], torch.Tensor)
    expected = [random.random() for _ in range(3)]
    restore_rng(state, torch.device("cpu"))
    assert [random.random() for _ in range(3)] == expected
    # A checkpoint of an earlier version holds the list form.
    state["python"][1] = state["python"][1].tolist()
    restore_rng(state, torch.device("cpu"))
    assert [random.random() for _ in range(3)] == expected
