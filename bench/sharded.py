"""Benchmark: checkpoints and memory beyond DDP.

1. How long training is blocked per checkpoint, against the state's size (64 MB to 2 GB) at
   2 ranks: the single file rank 0 writes (all others wait at a barrier), the same state as
   a folder through torch.distributed.checkpoint written at once, and written in the
   background (blocked: until the state is copied; written: until ``.metadata`` is in).
2. The bytes each rank writes for one folder of 256 MB at 1, 2 and 4 ranks (``wchar`` of
   /proc/self/io): a replicated state is split over the writers, so it falls as 1/W.
3. Per-rank memory, DDP against FSDP2, for a model whose AdamW state is about 2 GB, at 1, 2
   and 4 ranks: the bytes of parameters + gradients + optimizer state each rank holds, and
   its peak resident set; and once wrapped, the same model built whole on every rank or on
   the meta device (run.wrap then gives each rank its shards only).
4. Per-step cost of hpc_ddp's loop with dist.strategy=fsdp against a hand-written FSDP2 loop
   on the same model and batches, in turn inside one pair of ranks (bench.interleaved
   --fsdp), and the hand-written loop against its own copy (the method's control).

    python -m bench.sharded                  # all four; figures in bench/results/sharded.json
    python -m bench.sharded --materialised   # only the meta-device rows of part 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench.harness import launch, median, write_result
from bench.interleaved import measure

SIZES_MB = (64, 256, 1024, 2048)
WRITE_MB = 256
#: Paired rounds of the FSDP2 loops (an epoch of 32 steps each).
OVERHEAD_ROUNDS = 80
#: Paired rounds of the hand-written FSDP2 loop against its own copy.
CONTROL_ROUNDS = 40
#: Linear(4096, 4096) blocks: 16 of them hold 268 M parameters, an AdamW state of 2.1 GB.
MEMORY_WIDTH, MEMORY_BLOCKS = 4096, 16


def wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


def state_of(megabytes: int, device: str = "cpu") -> dict[str, Any]:
    """``megabytes`` of float32 in 16 tensors, as a model's state is spread over layers."""
    count = megabytes * 2**20 // 4 // 16
    return {f"layer{index}.weight": torch.rand(count, device=device) for index in range(16)}


def shared_dir(group: Any) -> Path:
    """One fresh folder under the home folder (a disk, not memory), named by rank 0."""
    made = [
        tempfile.mkdtemp(dir=Path.home(), prefix="bench-sharded-") if dist.get_rank() == 0 else ""
    ]
    dist.broadcast_object_list(made, src=0, group=group)
    return Path(made[0])


def blocked_times(sizes: list[int], repeats: int, device: str = "cpu") -> dict[str, Any]:
    """Each size's state saved ``repeats`` times each way; the folders through the same
    writer a run uses (it splits a replicated state over the ranks, see
    hpc_ddp.runtime.checkpoint.spread)."""
    from hpc_ddp.runtime.checkpoint.files import FORMAT_VERSION, save_checkpoint
    from hpc_ddp.runtime.checkpoint.writer import FolderSaves

    group = dist.new_group(backend="gloo")
    is_main = dist.get_rank() == 0
    rows = []
    for megabytes in sizes:
        tensors = state_of(megabytes, device)
        times: dict[str, list[float]] = {
            "single_file": [],
            "sync": [],
            "async": [],
            "async_written": [],
            "async_first": [],
        }
        directory = shared_dir(group)
        # Kept from save to save, as a run keeps it (with the copy's buffers).
        folders = FolderSaves(directory / "folders", 2, group, is_main)
        for repeat in range(repeats):
            dist.barrier()
            started = time.perf_counter()
            if is_main:
                state = {"format": FORMAT_VERSION, "objects": {"model": tensors}}
                save_checkpoint(state, directory, repeat, keep_last=1)
            dist.barrier()
            times["single_file"].append(time.perf_counter() - started)
            started = time.perf_counter()
            folders.write({"objects": {"model": tensors}}, 2 * repeat + 1, "sync", False)
            times["sync"].append(time.perf_counter() - started)
            dist.barrier()
            started = time.perf_counter()
            folders.write({"objects": {"model": tensors}}, 2 * repeat + 2, "async", True)
            # The first background save also allocates the copy's buffers, once per run.
            times["async" if repeat else "async_first"].append(time.perf_counter() - started)
            folders.wait()
            times["async_written"].append(time.perf_counter() - started)
        dist.barrier()
        if is_main:
            shutil.rmtree(directory)
        row = {"size_mb": megabytes, **{f"{key}_s": median(value) for key, value in times.items()}}
        row["async_blocked_share"] = row["async_s"] / row["sync_s"]
        rows.append(row)
        del tensors, folders
    return {"rows": rows}


def written_bytes(megabytes: int) -> dict[str, Any]:
    from hpc_ddp.runtime.checkpoint.sharded.writing import write_folder

    group = dist.new_group(backend="gloo")
    directory = shared_dir(group)
    tensors = state_of(megabytes)
    before = wchar()
    write_folder({"objects": {"model": tensors}}, directory / "step", group)
    mine = [wchar() - before]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine[0], group=group)
    dist.barrier()
    if dist.get_rank() == 0:
        for part in (directory / "step").iterdir():
            part.unlink()
        (directory / "step").rmdir()
        directory.rmdir()
    return {"world_size": dist.get_world_size(), "state_mb": megabytes,
            "written_mb": [value / 2**20 for value in every]}  # fmt: skip


def rank_memory(strategy: str) -> dict[str, Any]:
    """A few AdamW steps through hpc_ddp (run.wrap with ``strategy``); what each rank holds."""
    import hpc_ddp

    run = hpc_ddp.start(
        overrides=[f"dist.strategy={strategy}"],
        tracking={"enabled": False},
        checkpoint={"enabled": False},
        run={"output_dir": tempfile.mkdtemp(prefix="bench-memory-")},
    )
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Linear(MEMORY_WIDTH, MEMORY_WIDTH) for _ in range(MEMORY_BLOCKS))
    model = run.wrap(nn.Sequential(*blocks) if strategy == "ddp" else _Stack(blocks))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in run.iterations(2):
        model(torch.randn(8, MEMORY_WIDTH)).square().mean().backward()
        optimizer.step()
    held = {"parameters": 0, "gradients": 0, "optimizer": 0}
    for parameter in model.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        held["parameters"] += local.numel() * local.element_size()
        if parameter.grad is not None:
            grad = parameter.grad
            grad = grad.to_local() if hasattr(grad, "to_local") else grad
            held["gradients"] += grad.numel() * grad.element_size()
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local = value.to_local() if hasattr(value, "to_local") else value
                held["optimizer"] += local.numel() * local.element_size()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    every: list[Any] = [None] * run.world_size
    dist.all_gather_object(every, {**held, "peak_rss": peak})
    run.finish()
    return {"strategy": strategy, "world_size": run.world_size,
            "held_gb": sum(held.values()) / 2**30,
            "peak_rss_gb": max(row["peak_rss"] for row in every) / 2**30,
            "parameters": sum(p.numel() for p in model.parameters())}  # fmt: skip


def wrapped_memory(on_meta: bool) -> dict[str, Any]:
    """The same model as :func:`rank_memory`'s sharded by run.wrap (dist.strategy=fsdp),
    built whole on every rank or on the meta device; each rank's peak resident set once
    wrapped (before any step), against the bytes of its own shards."""
    import hpc_ddp

    run = hpc_ddp.start(
        overrides=["dist.strategy=fsdp"],
        tracking={"enabled": False},
        checkpoint={"enabled": False},
        run={"output_dir": tempfile.mkdtemp(prefix="bench-memory-")},
    )
    import torch.distributed.fsdp  # its code is not the model's memory

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with torch.device("meta" if on_meta else "cpu"):
        blocks = nn.ModuleList(nn.Linear(MEMORY_WIDTH, MEMORY_WIDTH) for _ in range(MEMORY_BLOCKS))
        stack = _Stack(blocks)
    whole = sum(p.numel() * p.element_size() for p in stack.parameters())
    model = run.wrap(stack)
    local = [getattr(p, "to_local", lambda p=p: p)() for p in model.parameters()]
    shards = sum(p.numel() * p.element_size() for p in local)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    every: list[Any] = [None] * run.world_size
    dist.all_gather_object(every, {"grown": peak - before, "peak": peak})
    run.finish()
    return {"built_on": "meta" if on_meta else "cpu", "world_size": run.world_size,
            "model_gb": whole / 2**30, "shard_gb": shards / 2**30,
            "block_gb": whole / MEMORY_BLOCKS / 2**30,
            "grown_gb": max(row["grown"] for row in every) / 2**30,
            "peak_rss_gb": max(row["peak"] for row in every) / 2**30}  # fmt: skip


class _Stack(nn.Module):
    """The same blocks in a ModuleList, which FSDP2 shards one by one by default."""

    def __init__(self, blocks: nn.ModuleList) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("part", choices=["blocked", "written", "memory", "wrapped"])
    parser.add_argument("--meta", action="store_true", help="wrapped: built on meta")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES_MB)))
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--device", default="cpu", help="where the blocked part's state lives")
    args = parser.parse_args(argv)
    if args.part == "memory":
        result: Any = rank_memory(args.strategy)
    elif args.part == "wrapped":
        result = wrapped_memory(args.meta)
    else:
        dist.init_process_group("gloo")
        if args.part == "blocked":
            sizes = [int(size) for size in args.sizes.split(",")]
            result = blocked_times(sizes, args.repeats, args.device)
        else:
            result = written_bytes(WRITE_MB)
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result), flush=True)


def run() -> dict[str, Any]:
    blocked = launch(2, "bench.sharded", ["blocked"], timeout=3600)[0]["rows"]
    for row in blocked:
        print(f"{row['size_mb']:5d} MB: blocked single file {row['single_file_s']:.2f} s, "
              f"DCP sync {row['sync_s']:.2f} s, DCP async {row['async_s']:.3f} s "
              f"({100 * row['async_blocked_share']:.0f}% of sync; written after "
              f"{row['async_written_s']:.2f} s)", flush=True)  # fmt: skip
    written = [launch(world, "bench.sharded", ["written"])[0] for world in (1, 2, 4)]
    for one in written:
        shares = ", ".join(f"{mb:.0f}" for mb in one["written_mb"])
        print(f"W={one['world_size']}: each rank wrote {shares} MB of {WRITE_MB} MB", flush=True)
    memory = []
    # DDP holds the whole state on every rank: 4 ranks of it would need about 20 GB here.
    for strategy, worlds in (("ddp", (1, 2)), ("fsdp", (1, 2, 4))):
        for world in worlds:
            held = launch(world, "bench.sharded", ["memory", "--strategy", strategy], 1800)[0]
            memory.append(held)
            print(f"{strategy} W={world}: {held}", flush=True)
    materialised = materialised_memory()
    overhead = measure("compute_bound", OVERHEAD_ROUNDS, fsdp=True)
    # The hand-written FSDP2 loop against its own copy: what the method reads for no
    # difference at all.
    control = measure("compute_bound", CONTROL_ROUNDS, control=True, fsdp=True)
    result = {
        "blocked": blocked,
        "written": written,
        "memory": memory,
        "materialised": materialised,
        "overhead": overhead,
        "overhead_control": control,
    }
    write_result("sharded", result)
    return result


def materialised_memory() -> list[dict[str, Any]]:
    """Each rank's memory once run.wrap sharded the model, built whole or on meta."""
    rows = []
    for on_meta in (False, True):
        for world in (2, 4):
            extra = ["--meta"] if on_meta else []
            rows.append(launch(world, "bench.sharded", ["wrapped", *extra], 1800)[0])
            print(f"wrapped W={world}: {rows[-1]}", flush=True)
    return rows


if __name__ == "__main__":
    if sys.argv[1:] == ["--materialised"]:  # this part alone, into the recorded figures
        recorded = json.loads((Path(__file__).parent / "results" / "sharded.json").read_text())
        recorded.pop("machine", None)
        write_result("sharded", {**recorded, "materialised": materialised_memory()})
    elif len(sys.argv) > 1:
        worker(sys.argv[1:])
    else:
        run()
