"""Checks of the ranks' hardware and files before the first step, each failure a
:class:`Finding` (the check, what was seen, what was expected).

A GPU that returns NaN or a wrong product, a GPU another process holds, a broken collective
path, a run directory that takes no write, a node the site's own health check fails: each is
found in the first seconds, on the rank that meets it, instead of hours into the allocation.
The same functions run on a CPU rank with the same structure (its product checked on the
CPU), so the code path is exercised where no GPU is."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist

from hpc_ddp.runtime.errors import error_line

#: Side of the square product each device computes: 2**11 is exact in bfloat16 and float32.
PRODUCT_SIZE = 2048
#: Side of the seeded product compared with a float64 reference on the CPU.
REFERENCE_SIZE = 256
#: The largest error of the seeded product, relative to its largest entry, per dtype (about
#: 30 times what a healthy H200 shows: 2.5e-7 in float32, 3.4e-3 in bfloat16). float32 is
#: checked at full precision; where NVIDIA_TF32_OVERRIDE=1 forces TF32, with TF32's bound.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2}
TF32_TOLERANCE = 5e-3
#: The all-reduce timed for checks.min_allreduce_gbps.
BANDWIDTH_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Finding:
    """One failed check on one rank."""

    check: str
    seen: str
    expected: str

    def line(self) -> str:
        return f"{self.check}: {self.seen}; expected {self.expected}"


def product_findings(device: torch.device, dtype: torch.dtype, size: int) -> list[Finding]:
    """``device`` computes ``ones(size, size) @ ones(size, size)`` (every entry ``size``) and a
    seeded product close to a float64 one on the CPU."""
    name = f"gpu {device}" if device.type == "cuda" else f"cpu {device}"
    ones = torch.ones(size, size, device=device, dtype=dtype)
    findings = ones_finding((ones @ ones).float().cpu(), size, name, dtype)
    generator = torch.Generator().manual_seed(0)
    left, right = (torch.randn(REFERENCE_SIZE, REFERENCE_SIZE, generator=generator,
                               dtype=torch.float64) for _ in range(2))  # fmt: skip
    reference = left @ right
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # a script's TF32 is no fault of the GPU
    try:
        got = (left.to(device, dtype) @ right.to(device, dtype)).double().cpu()
    finally:
        torch.set_float32_matmul_precision(precision)
    error = float(((got - reference).abs().max() / reference.abs().max()).item())
    forced_tf32 = os.environ.get("NVIDIA_TF32_OVERRIDE") == "1" and device.type == "cuda"
    bound = TF32_TOLERANCE if forced_tf32 and dtype == torch.float32 else TOLERANCE[dtype]
    return findings + reference_finding(error, name, dtype, bound)


def ones_finding(product: torch.Tensor, size: int, name: str, dtype: torch.dtype) -> list[Finding]:
    """A product of two all-ones ``size`` x ``size`` matrices with an entry other than
    ``size`` (NaN and Inf counted apart)."""
    nan, inf = int(product.isnan().sum()), int(product.isinf().sum())
    wrong = int((product != size).sum()) - nan - inf
    if not (nan or inf or wrong):
        return []
    seen = f"ones({size}, {size}) @ ones in {str(dtype)[6:]}: {nan} NaN, {inf} Inf, {wrong} wrong"
    return [Finding(name, f"{seen} of {product.numel()} entries", f"every entry {size}")]


def reference_finding(
    error: float, name: str, dtype: torch.dtype, bound: float | None = None
) -> list[Finding]:
    """A seeded product off its float64 reference by ``error`` (relative to its largest
    entry) beyond ``bound`` (default: the dtype's tolerance); NaN fails too."""
    bound = TOLERANCE[dtype] if bound is None else bound
    if error <= bound:
        return []
    seen = (
        f"a seeded {REFERENCE_SIZE}x{REFERENCE_SIZE} product in {str(dtype)[6:]} off by "
        f"{error:.2g} of its largest entry"
    )
    return [Finding(name, seen, f"at most {bound:g}")]


def memory_finding(device: torch.device, min_free: float) -> Finding | None:
    """A GPU with less than ``min_free`` of its memory free before training, counting what
    this process's own allocator holds (an earlier run in it) as free."""
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device)
    if free >= min_free * total:
        return None
    return Finding(
        f"gpu {device}",
        f"{(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB held by other processes before "
        "training",
        f"at least {min_free:.0%} free (checks.min_free_gpu_memory)",
    )


def device_findings(devices: Sequence[str], min_free: float) -> list[Finding]:
    """Each of this rank's devices: free memory and known products (float32, and bfloat16
    on a GPU)."""
    findings: list[Finding] = []
    for name in devices:
        device = torch.device(name)
        if device.type != "cuda":
            findings += product_findings(device, torch.float32, REFERENCE_SIZE)
            continue
        if not torch.cuda.is_available():
            findings.append(Finding(f"gpu {device}", f"torch {torch.__version__} sees no CUDA "
                                    "device (a CPU build of torch, or no driver here)",
                                    "the GPU the launch plan gives this rank"))  # fmt: skip
            continue
        lacking = memory_finding(device, min_free)
        findings += [lacking] if lacking else []
        for dtype in (torch.float32, torch.bfloat16):
            findings += product_findings(device, dtype, PRODUCT_SIZE)
        torch.cuda.synchronize(device)
    return findings


def storage_findings(run_dir: Path, rank: int) -> list[Finding]:
    """The run directory takes a write that reaches the disk (fsync) and reads back."""
    probe = run_dir / f".check-write-{rank}"
    data = os.urandom(4096)
    try:
        with open(probe, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        same = probe.read_bytes() == data
    except OSError as error:
        return [Finding("storage", f"writing {probe}: {error.strerror or error}",
                        "a run directory this user can write and fsync")]  # fmt: skip
    finally:
        probe.unlink(missing_ok=True)
    if same:
        return []
    return [Finding("storage", f"{probe} read back other bytes than were written", "the same")]


def command_findings(command: str, timeout_s: float, environ: Mapping[str, str]) -> list[Finding]:
    """The site's own check, through the shell: a non-zero exit or a timeout fails the node."""
    try:
        done = subprocess.run(
            command,
            shell=True,
            env=dict(environ),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        seen = f"`{command}` still running after {timeout_s:g} s (stopped)"
        return [Finding("checks.command", seen, "an exit within checks.timeout_s")]
    if done.returncode == 0:
        return []
    said = " | ".join((done.stdout + done.stderr).strip().splitlines()[-3:])[-300:]
    seen = f"`{command}` exited with {done.returncode}" + (f": {said}" if said else "")
    return [Finding("checks.command", seen, "exit 0")]


def collective_findings(rank: int, world_size: int, device: torch.device) -> list[Finding]:
    """Every rank's known value (its rank + 1) gathered over the training backend: a wrong
    slot names the rank it came from."""
    mine = torch.tensor([float(rank + 1)], device=device)
    gathered = [torch.zeros(1, device=device) for _ in range(world_size)]
    try:
        torch_dist.all_gather(gathered, mine)
    except Exception as error:
        return [Finding("collective", error_line(error), "an all-gather over every rank")]
    got = [float(value.item()) for value in gathered]
    wrong = [f"rank {index}: {value:g}" for index, value in enumerate(got) if value != index + 1]
    if not wrong:
        return []
    seen = f"an all-gather of each rank's rank+1 gave {', '.join(wrong[:4])}"
    return [Finding("collective", seen, "each rank's rank+1")]


def allreduce_gbps(world_size: int, device: torch.device) -> float:
    """Bus bandwidth of a :data:`BANDWIDTH_BYTES` all-reduce over every rank (GB/s), timed
    after one warm-up, as nccl-tests count it: 2(W-1)/W of the bytes cross each link."""
    values = torch.ones(BANDWIDTH_BYTES // 4, device=device)
    torch_dist.all_reduce(values)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    began = time.perf_counter()
    torch_dist.all_reduce(values)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = max(time.perf_counter() - began, 1e-9)
    return 2 * (world_size - 1) / world_size * BANDWIDTH_BYTES / seconds / 1e9


def bandwidth_findings(gbps: float, floor: float) -> list[Finding]:
    if gbps >= floor:
        return []
    return [Finding("collective bandwidth", f"{gbps:.1f} GB/s (a 64 MB all-reduce)",
                    f"at least {floor:g} GB/s (checks.min_allreduce_gbps)")]  # fmt: skip


def timed(results: dict[str, float], name: str, check: Any, *args: Any) -> list[Finding]:
    """``check(*args)``, its seconds kept in ``results[name]``; a check that raises (a CUDA
    error, memory a crowded GPU cannot give) is a finding, so that every rank goes on to the
    gather that names it instead of leaving the others waiting there."""
    began = time.perf_counter()
    try:
        return list(check(*args))
    except Exception as error:
        return [Finding(name, error_line(error), "the check to run without an error")]
    finally:
        results[name] = round(time.perf_counter() - began, 3)
