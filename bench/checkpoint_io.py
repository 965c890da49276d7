"""Benchmark 3: checkpoint save (atomic, fsynced) and load (weights_only) time vs size."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.harness import median, write_result
from hpc_ddp.runtime.checkpoint import FORMAT_VERSION, load_newest, save_checkpoint

WIDTHS = (256, 1024, 2048, 4096)


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
    write_result("checkpoint_io", {"rows": rows})
    return {"rows": rows}


if __name__ == "__main__":
    run()
