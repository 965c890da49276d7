"""Benchmark: what timing the step's parts costs the training thread on a CPU: torch's global
optimizer step hooks (``interval/optimizer_percent``) a step, the forward timer
(``interval/forward_percent``, the slowest rank) a timed forward, as under FSDP where every
sharded block has one, and the timer of ``monitor.time_gradient_sync``
(``interval/gradient_sync_percent``: a gradient hook and two autograd callbacks) a DDP
backward (one rank over loopback gloo, so the all-reduce itself costs next to nothing and
the timer's own work shows).

One process, one thread: the same small optimizer step and the same small block's forward,
in rounds that alternate with and without the timer, so the machine's drift hits both
alike. A round's figure is its mean per call; the cost is the median over rounds of the
difference.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.harness import write_result

ROUNDS = 40
CALLS = 2000


def _per_call_us(call: Callable[[], Any]) -> float:
    started = time.perf_counter()
    for _ in range(CALLS):
        call()
    return (time.perf_counter() - started) / CALLS * 1e6


def _paired(
    call: Callable[[], Any], on: Callable[[], Any], off: Callable[[], Any]
) -> dict[str, float]:
    """Rounds of ``call`` timed (after ``on()``) and not (after ``off()``), alternating,
    each side first in every other round (so that which runs first is no bias)."""
    with_timer, without = [], []
    for round_index in range(ROUNDS):
        if round_index % 2:
            without.append(_per_call_us(call))
        on()
        with_timer.append(_per_call_us(call))
        off()
        if not round_index % 2:
            without.append(_per_call_us(call))
    return {
        "with_us": statistics.median(with_timer),
        "without_us": statistics.median(without),
        "cost_us": statistics.median(a - b for a, b in zip(with_timer, without, strict=True)),
    }


def _optimizer_hooks() -> dict[str, float]:
    from hpc_ddp.runtime.monitor.steptimers import OptimizerMeter

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    meter = OptimizerMeter(torch.device("cpu"))

    def detach() -> None:
        meter.take()
        meter.detach()

    return _paired(optimizer.step, meter.attach, detach)


def _forward_timer() -> dict[str, float]:
    from hpc_ddp.runtime.loop.streams import map_tensors
    from hpc_ddp.runtime.monitor.forward.meter import ForwardMeter

    block = torch.nn.Linear(64, 64)
    batch = torch.randn(8, 64)
    meter = ForwardMeter(torch.device("cpu"), False, map_tensors)

    def detach() -> None:
        meter.take()
        meter.detach()

    return _paired(lambda: block(batch), lambda: meter.attach(block), detach)


def _gradient_sync_timer() -> dict[str, float]:
    """A forward and backward of one DDP model, timed and not, alternating."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hpc_ddp.runtime.monitor.gradsync import GradientSyncMeter

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        model = DistributedDataParallel(net)
        meter = GradientSyncMeter(torch.device("cpu"), enabled=True)
        batch = torch.randn(16, 32)

        def detach() -> None:
            meter.take()
            meter.detach()

        return _paired(lambda: model(batch).sum().backward(), lambda: meter.attach(model), detach)
    finally:
        dist.destroy_process_group()


def run() -> dict[str, Any]:
    torch.set_num_threads(1)
    result: dict[str, Any] = {
        "rounds": ROUNDS,
        "calls": CALLS,
        "optimizer_step": _optimizer_hooks(),
        "timed_forward": _forward_timer(),
        "gradient_sync": _gradient_sync_timer(),
    }
    for part in ("optimizer_step", "timed_forward", "gradient_sync"):
        found = result[part]
        print(f"{part}: {found['without_us']:.2f} us, timed {found['with_us']:.2f} us "
              f"(+{found['cost_us']:.2f} us)")  # fmt: skip
    write_result("step_timers", result)
    return result


if __name__ == "__main__":
    run()
