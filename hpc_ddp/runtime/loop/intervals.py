"""Training metrics between log intervals and over epochs, summed across ranks off the hot
path: each interval's all-reduce runs in the background and is read one interval later."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from hpc_ddp.runtime.arguments import is_number
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.logs import Progress, get_logger
from hpc_ddp.runtime.loop.context import RunContext
from hpc_ddp.runtime.loop.metrics import PendingSums, Sum, Sums, restore_sums, saved_sums
from hpc_ddp.runtime.loop.streams import Ticks, batch_length
from hpc_ddp.runtime.monitor.datawait import (
    DataWait,
    DataWaitAlarm,
    data_wait_shares,
    loader_settings,
)
from hpc_ddp.runtime.monitor.straggler import STRAGGLER_METRICS, StragglerAlarm
from hpc_ddp.runtime.monitor.system import SystemMonitor, gpu_text
from hpc_ddp.runtime.monitor.throughput import THROUGHPUT_METRICS, Throughput, throughput
from hpc_ddp.runtime.monitor.usage import USAGE_FIELDS, from_slot, to_slot
from hpc_ddp.runtime.names import check_name

#: Interval metrics the run logs itself (as interval/<name>).
RESERVED_METRICS = frozenset(
    {"lr", "samples_per_s", "steps_per_s", "data_wait_percent", "data_wait_percent_max",
     *THROUGHPUT_METRICS, *STRAGGLER_METRICS}
)  # fmt: skip


def run_throughput(context: RunContext) -> Throughput:
    """What the run's samples are worth (the monitor settings), on this rank's device."""
    device = context.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    monitor = context.config.monitor
    return throughput(
        monitor.tokens_per_sample, monitor.flops_per_sample, monitor.peak_tflops, name,
        context.env.world_size,
    )  # fmt: skip


def system_monitor(context: RunContext) -> SystemMonitor | None:
    """This rank's readings of its GPU and processes (None: monitor.every_s=0)."""
    if context.config.monitor.every_s <= 0:
        return None
    host = context.environ.get("SLURMD_NODENAME") or context.env.hostname
    return SystemMonitor(
        context.config.monitor, context.device, host, context.control_group, context.env.is_main,
        context.signals.stop_without_requeue,
    )  # fmt: skip


def check_logged_name(name: object) -> None:
    """A name ``run.log`` can take: one MLflow takes, and not one the run logs itself."""
    check_name(name, "run.log")
    if name in RESERVED_METRICS:
        raise HpcDdpError(
            f"run.log({name!r}, ...): the run logs interval/{name} itself",
            f"log it under another name (e.g. 'my_{name}'), or with run.log_metrics()",
        )


def check_logged_value(name: str, total: torch.Tensor | float, count: torch.Tensor | float) -> None:
    """A total and count ``run.log`` can take: a number or 0-d tensor over a count above 0
    (what needs no device sync to check)."""
    if isinstance(total, torch.Tensor):
        if total.dim() != 0:
            raise HpcDdpError(
                f"run.log({name!r}, ...) got a tensor of shape {tuple(total.shape)}",
                "log a scalar (e.g. loss.detach() * batch_size); use run.sums() for tensors",
            )
    elif not is_number(total):
        raise HpcDdpError(
            f"run.log({name!r}, {total!r}, ...): the total is a {type(total).__name__}",
            "pass a number or a 0-d tensor: the metric's sum over count items",
        )
    if not isinstance(count, torch.Tensor) and not (is_number(count) and count > 0):
        raise HpcDdpError(
            f"run.log({name!r}, ..., count={count!r}): the count must be a number above 0",
            "pass how many items the total sums over (e.g. the batch's size)",
        )


@dataclass(frozen=True)
class IntervalReport:
    """One log interval's metrics, summed across ranks in the background, followed by a
    slot per rank: its seconds of waiting for data and in its model's forward, then (with
    the system monitor on) its figures in :data:`USAGE_FIELDS` order."""

    sums: PendingSums
    names: list[str]
    step: int
    epoch: int
    steps: int
    seconds: float
    lr: float | None
    #: False where the loop handed out no batches (run.iterations: the script loads its own).
    data_timed: bool


class MetricLog:
    """What :meth:`hpc_ddp.Run.log` adds up: per interval (progress line, ``interval/<name>``)
    and per epoch (``<name>``, :attr:`epoch_metrics`)."""

    def __init__(self, context: RunContext) -> None:
        self.context = context
        self.interval = Sums(context.device, context.control_group)
        self.epoch = Sums(context.device, context.control_group)
        #: The last finished epoch's metrics, summed over all ranks.
        self.epoch_metrics: dict[str, Sum] = {}
        #: Samples per step over all ranks (from the loader), for samples/s.
        self.global_batch_size = 0
        self.progress = Progress(None, enabled=False)
        self._pending: IntervalReport | None = None
        self._checked_names: set[str] = set()
        self._non_finite_said: set[str] = set()
        #: This rank's wait inside the loader's ``next`` (the loop times it).
        self.data_wait = DataWait()
        self._data_wait_alarm = DataWaitAlarm(context.config.monitor.data_wait_percent)
        self._loader_settings = ""
        self._data_timed = True
        self._throughput = run_throughput(context)
        self.system = system_monitor(context)
        self._stragglers = StragglerAlarm(context.config.monitor.straggler_ratio)
        self._slot_width = 2 + (len(USAGE_FIELDS) if self.system else 0)

    def add(self, name: str, total: torch.Tensor | float, count: torch.Tensor | float) -> None:
        """A training metric's total over ``count`` items (see :meth:`hpc_ddp.Run.log`);
        what can be checked without a device sync is checked (a name once)."""
        if name not in self._checked_names:
            check_logged_name(name)
            self._checked_names.add(name)
        check_logged_value(name, total, count)
        self.interval.add(name, total, count)

    def close(self) -> None:
        """End the progress display and the readings of the machine."""
        self.progress.close()
        if self.system is not None:
            self.system.close()

    def measure_batch(self, batch: Any, grad_accum_steps: int) -> None:
        """The global batch of a user's iterable, from a micro-batch (for samples/s and the
        summary's samples_seen); unknown for batches that hold no tensor."""
        size = batch_length(batch)
        if size is not None:
            self.set_batch(size, grad_accum_steps)

    def set_batch(self, micro_batch: int, grad_accum_steps: int) -> None:
        """Samples per micro-batch on each rank, and micro-batches per step: the global batch,
        said once on rank 0 (a script's own batch split is seen nowhere else)."""
        world_size = self.context.env.world_size
        size = micro_batch * grad_accum_steps * world_size
        if size != self.global_batch_size and self.context.env.is_main:
            get_logger().info(
                f"global batch {size} = {world_size} rank(s) x {micro_batch} per micro-batch x "
                f"{grad_accum_steps} micro-batch(es) per step"
            )
        self.global_batch_size = size

    def use_loader(self, loader: Any) -> None:
        """The loader the next steps come from (its settings go into the data-wait HINT);
        the wait counted before it (an epoch's partial interval) is dropped."""
        self._loader_settings = loader_settings(loader)
        self._data_timed = not isinstance(getattr(loader, "batches", None), Ticks)
        self.data_wait.take()

    def _move_interval_to_epoch(self) -> tuple[list[str], torch.Tensor]:
        """The interval's metrics, packed, added to the epoch's (a collective: the names are
        compared across ranks)."""
        self.interval.agree()
        names, local = self.interval.names, self.interval.local()
        for index, name in enumerate(names):
            self.epoch.add(name, local[2 * index], local[2 * index + 1])
        self.interval.clear()
        return names, local

    def close_interval(self, step: int, epoch: int, steps: int, seconds: float) -> None:
        """Start summing this interval's metrics (and every rank's wait for data) across
        ranks; publish the previous one's.

        The all-reduce runs in the background until the next log step, so no rank waits for
        the others here and a GPU is never synchronised; each interval's line and metrics
        appear one interval late, under their own step."""
        names, local = self._move_interval_to_epoch()
        env = self.context.env
        # Filled on the device, not copied from the host: on a GPU a copy from pageable
        # memory may wait for the queued work. The cat is a new tensor, so the all-reduce
        # never writes into the views the epoch's sums hold.
        shape = (env.world_size, self._slot_width)
        slots = torch.zeros(shape, dtype=torch.float64, device=local.device)
        usage = to_slot(self.system.sampler.take()) if self.system else ()
        mine = (self.data_wait.take(), self.context.forward.take(), *usage)
        for index, value in enumerate(mine):  # a fill each: a handful per interval
            slots[env.rank, index] = value
        local = torch.cat([local, slots.reshape(-1)])
        lr = self.context.current_lr()
        report = IntervalReport(
            PendingSums(local), names, step, epoch, steps, seconds, lr, self._data_timed
        )
        self.publish()
        self._pending = report

    def publish(self) -> None:
        """Log the interval whose sums are on their way (if any): progress line and metrics."""
        report, self._pending = self._pending, None
        if report is None:
            return
        values = report.sums.result()
        means = {
            name: values[2 * i] / values[2 * i + 1] if values[2 * i + 1] else float("nan")
            for i, name in enumerate(report.names)
        }
        counted = {name for i, name in enumerate(report.names) if values[2 * i + 1]}
        self._say_non_finite({name: means[name] for name in counted}, report.step)
        steps_per_s = report.steps / max(1e-9, report.seconds)
        metrics = {f"interval/{name}": value for name, value in means.items()}
        slots = values[2 * len(report.names) :]
        rows = [slots[at : at + self._slot_width] for at in range(0, len(slots), self._slot_width)]
        if report.data_timed:
            shares = data_wait_shares([row[0] for row in rows], report.seconds)
            metrics["interval/data_wait_percent"] = shares.mean_percent
            metrics["interval/data_wait_percent_max"] = shares.worst_percent
            said = self._data_wait_alarm.observe(shares, self._loader_settings)
            if said is not None and self.context.env.is_main:
                get_logger().warning(said)
        if self.global_batch_size:
            samples_per_s = steps_per_s * self.global_batch_size
            rate = f"{samples_per_s:,.0f} samples/s"
            metrics["interval/samples_per_s"] = samples_per_s
            worth = self._throughput.metrics(samples_per_s, self.context.forward.flops_per_sample)
            metrics.update({f"interval/{name}": value for name, value in worth.items()})
            if "tokens_per_s" in worth:
                rate += f", {worth['tokens_per_s']:,.0f} tokens/s"
        else:  # a user's batches of no known size
            rate = f"{steps_per_s:,.2f} steps/s"
            metrics["interval/steps_per_s"] = steps_per_s
        if self.context.forward.attached and self.context.env.is_main:
            hosts = [place.host for place in self.system.places] if self.system else None
            slowest, said = self._stragglers.metrics([row[1] for row in rows], hosts)
            metrics.update({f"interval/{name}": value for name, value in slowest.items()})
            if said is not None:
                get_logger().warning(said)
        if self.system and self.context.env.is_main:
            system = self.system.metrics([from_slot(row[2:]) for row in rows])
            metrics.update(system)
            rate += gpu_text(system)
        self.progress.update(report.step, report.epoch, means, rate)
        if report.lr is not None:
            metrics["interval/lr"] = report.lr
        self.context.tracker.log_metrics(metrics, report.step)

    def _say_non_finite(self, means: dict[str, float], step: int) -> None:
        """Once per metric, on rank 0: a NaN or infinite value over items that exist."""
        for name, value in means.items():
            if not math.isfinite(value) and name not in self._non_finite_said:
                self._non_finite_said.add(name)
                if self.context.env.is_main:
                    get_logger().warning(
                        f"{name} is {value} in the metrics at step {step}: training "
                        "diverged, or a logged total holds NaN/inf. HINT: lower the learning "
                        "rate or clip gradients; check the inputs of the first such step"
                    )

    def end_epoch(self, epoch: int, step: int) -> None:
        """The epoch's metrics, summed over all ranks, logged at ``step`` (the global step the
        epoch ended at: every metric the run logs shares the step axis)."""
        self.publish()
        self._move_interval_to_epoch()
        self.epoch_metrics = self.epoch.reduce()
        self.epoch.clear()
        scalars = {
            name: float(value.mean)
            for name, value in self.epoch_metrics.items()
            if not isinstance(value.total, torch.Tensor)
        }
        if scalars:
            self.context.tracker.log_metrics(scalars, step)
            if self.context.env.is_main:
                get_logger().info(f"epoch {epoch} ended: {metric_text(scalars)}")
            counted = {name for name, value in self.epoch_metrics.items() if value.count}
            self._say_non_finite({n: v for n, v in scalars.items() if n in counted}, step)

    def saved(self) -> dict[str, Any]:
        """The partial sums, over all ranks, for a checkpoint (a collective)."""
        return {"interval": saved_sums(self.interval), "epoch": saved_sums(self.epoch)}

    def restore(self, saved: dict[str, Any]) -> None:
        """Carry a checkpoint's partial sums on (rank 0 holds them; they are global)."""
        carrier = self.context.env.is_main
        restore_sums(self.interval, saved["interval"], carrier=carrier)
        restore_sums(self.epoch, saved["epoch"], carrier=carrier)


def metric_text(values: dict[str, float]) -> str:
    """``values`` for a log line: name value, name value, ..."""
    return ", ".join(f"{name} {value:.6g}" for name, value in values.items())
