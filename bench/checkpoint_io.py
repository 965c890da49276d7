"""Benchmark 3: checkpoint save (atomic, fsynced) and load (weights_only) time vs size, and
what several ranks of one node read from storage when they resume from the same file."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.harness import median, write_result
from hpc_ddp.runtime.checkpoint.files import FORMAT_VERSION, load_newest, save_checkpoint

WIDTHS = (256, 1024, 2048, 4096)
#: Ranks of one node that load the same checkpoint at once, as at a resume.
READERS = 4
#: One rank's resume: the toolkit's load (memory-mapped), then every tensor used; what the
#: process read from storage (not from the page cache) is its read_bytes in /proc/self/io.
READ_ONE = """
import sys
from pathlib import Path
from hpc_ddp.runtime.checkpoint.files import load_checkpoint
import torch
def tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict | list | tuple):
        for item in value.values() if isinstance(value, dict) else value:
            yield from tensors(item)
state = load_checkpoint(Path(sys.argv[1]))
total = sum(float(tensor.sum()) for tensor in tensors(state))
io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
print(io["read_bytes"])
"""


def evict(path: Path) -> None:
    """Drop the file's pages from the page cache, as on a node that never read it."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


def shared_read(path: Path, readers: int = READERS) -> dict[str, Any]:
    """``readers`` processes load ``path`` at once after it was evicted from the page cache;
    the bytes each read from storage."""
    evict(path)
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", READ_ONE, str(path)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(readers)
    ]
    read = [int(process.communicate(timeout=300)[0].split()[-1]) for process in processes]
    size = path.stat().st_size
    return {"readers": readers, "size_mb": size / 2**20, "read_mb": [b / 2**20 for b in read],
            "storage_reads_per_file": sum(read) / size}  # fmt: skip


def run(repeats: int = 3) -> dict[str, Any]:
    rows = []
    for width in WIDTHS:
        model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(2, width)).sum().backward()
        optimizer.step()
        state = {
            "format": FORMAT_VERSION,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "global_step": 1,
        }
        saves, loads, size = [], [], 0
        with tempfile.TemporaryDirectory() as directory:
            for step in range(repeats):
                started = time.perf_counter()
                path = save_checkpoint(state, Path(directory), step, keep_last=2)
                saves.append(time.perf_counter() - started)
                size = path.stat().st_size
                started = time.perf_counter()
                assert load_newest(Path(directory)) is not None
                loads.append(time.perf_counter() - started)
        rows.append(
            {
                "parameters": sum(p.numel() for p in model.parameters()),
                "size_mb": size / 2**20,
                "save_s": median(saves),
                "load_s": median(loads),
            }
        )
        print(
            f"{size / 2**20:8.1f} MB: save {median(saves):.3f} s, load {median(loads):.3f} s",
            flush=True,
        )
    with tempfile.TemporaryDirectory(dir=Path.home()) as directory:
        # Under the home folder, not /tmp: /tmp may be memory, where nothing is read from disk.
        path = save_checkpoint(state, Path(directory), 0, keep_last=1)
        shared = shared_read(path)
    print(
        f"{READERS} ranks loading one {shared['size_mb']:.0f} MB file read "
        f"{shared['storage_reads_per_file']:.2f} x its size from storage",
        flush=True,
    )
    write_result("checkpoint_io", {"rows": rows, "shared_read": shared})
    return {"rows": rows, "shared_read": shared}


if __name__ == "__main__":
    run()
