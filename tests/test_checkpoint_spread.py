"""A replicated state split over the ranks before a folder save: each rank copies and writes
only its share (on a real 3-rank gloo group), and the folder still holds every tensor."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import TCPStore  # type: ignore[attr-defined]
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.multiprocessing.spawn import spawn

from hpc_ddp.launch.local import free_loopback_port
from hpc_ddp.runtime.checkpoint.sharded.reading import full_tensors
from hpc_ddp.runtime.checkpoint.spread import layout_of, own_share, writers
from hpc_ddp.runtime.checkpoint.writer import FolderSaves

WORLD = 3
#: Float32 elements of the replicated tensors: unequal, so the split has to balance them.
SIZES = {"a": 4000, "b": 3000, "c": 2500, "d": 1500, "e": 1000, "f": 100}


class CountingStager(DefaultStager):
    """The stager a background save copies through, counting the bytes it was handed."""

    def __init__(self) -> None:
        super().__init__(StagingOptions(False, False, False, False))
        self.staged_bytes: list[int] = []

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        tensors = [value for value in _leaves(state_dict) if isinstance(value, torch.Tensor)]
        self.staged_bytes.append(sum(value.numel() * value.element_size() for value in tensors))
        return super().stage(state_dict, **kwargs)


def _leaves(state: Any) -> list[Any]:
    if isinstance(state, dict):
        return [leaf for value in state.values() for leaf in _leaves(value)]
    return [state]


def replicated() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(5)
    tensors = {name: torch.rand(count, generator=generator) for name, count in SIZES.items()}
    return {"objects": {"model": tensors, "optimizer": {"lr": 0.1}}}


def _rank(rank: int, port: int, directory: str, results: Any) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    folders = FolderSaves(Path(directory), 5, dist.new_group(backend="gloo"), rank == 0)
    folders.stager = CountingStager()
    folders.write(replicated(), 1, "periodic", background=True)
    folders.wait()
    # Rank 2 holds one tensor more: the ranks do not hold the same state, so none is split.
    state = replicated()
    if rank == 2:
        state["objects"]["model"]["only_on_2"] = torch.full((10,), 7.0)
    folders.write(state, 2, "periodic", background=True)
    folders.wait()
    results.put((rank, folders.stager.staged_bytes))
    dist.destroy_process_group()


@pytest.mark.e2e
def test_each_rank_copies_only_its_share_of_a_replicated_state(tmp_path: Path) -> None:
    results = mp.get_context("spawn").SimpleQueue()
    spawn(_rank, args=(free_loopback_port(), str(tmp_path), results), nprocs=WORLD)
    staged = dict(results.get() for _ in range(WORLD))
    whole = 4 * sum(SIZES.values())
    split = [staged[rank][0] for rank in range(WORLD)]
    assert sum(split) == whole, f"each tensor is copied once over the ranks: {split}"
    assert split == [16400, 16000, 16000], "balanced: largest first, to the least loaded"
    assert [staged[rank][1] for rank in range(WORLD)] == [whole, whole, whole + 40]

    expected = replicated()["objects"]["model"]
    for step in (1, 2):
        saved = full_tensors(tmp_path / f"step-{step:09d}", "model")
        extra = {"only_on_2": torch.full((10,), 7.0)} if step == 2 else {}
        assert saved.keys() == {**expected, **extra}.keys()
        for name, tensor in {**expected, **extra}.items():
            assert torch.equal(saved[name], tensor), (step, name)


def test_the_split_puts_the_largest_first_on_the_least_loaded_rank() -> None:
    sizes: dict[tuple[str, ...], int] = {("m", name): 4 * n for name, n in SIZES.items()}
    assert writers(sizes, 3) == {
        ("m", "a"): 0,
        ("m", "b"): 1,
        ("m", "c"): 2,
        ("m", "d"): 2,  # rank 2 held the fewest bytes (10,000)
        ("m", "e"): 1,  # then rank 1 (12,000)
        ("m", "f"): 0,  # each held 16,000: the lowest rank
    }
    assert writers(sizes, 1) == dict.fromkeys(sizes, 0)


def test_a_share_keeps_every_value_that_is_not_a_replicated_tensor() -> None:
    state = replicated()
    shares = [own_share(state, rank, 2) for rank in range(2)]
    for share in shares:
        assert share["objects"]["optimizer"] == {"lr": 0.1}
    names = [set(share["objects"]["model"]) for share in shares]
    assert names[0].isdisjoint(names[1]) and names[0] | names[1] == set(SIZES)
    assert set(state["objects"]["model"]) == set(SIZES), "the state itself is not changed"
    assert layout_of(state) == layout_of(replicated())
    state["objects"]["model"]["a"] = torch.zeros(4000, dtype=torch.float64)
    assert layout_of(state) != layout_of(replicated())
