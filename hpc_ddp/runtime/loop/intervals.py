"""Training metrics between log intervals and over epochs, summed across ranks off the hot
path: each interval's all-reduce runs in the background and is read one interval later."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hpc_ddp.runtime.logs import Progress, get_logger
from hpc_ddp.runtime.loop.context import RunContext
from hpc_ddp.runtime.loop.logged import check_logged_name, check_logged_value
from hpc_ddp.runtime.loop.metrics import (
    NonFiniteWarnings,
    PendingSums,
    Sum,
    Sums,
    restore_sums,
    saved_sums,
)
from hpc_ddp.runtime.loop.streams import Ticks, batch_length
from hpc_ddp.runtime.monitor.datawait import loader_settings
from hpc_ddp.runtime.monitor.paces import IntervalPaces, RankTimes, timed_per_rank
from hpc_ddp.runtime.monitor.steptimers import StepTimers
from hpc_ddp.runtime.monitor.system import IDLE_GPUS_TAG, SystemMonitor, gpu_text
from hpc_ddp.runtime.monitor.throughput import (
    Throughput,
    counted_flops_per_s,
    throughput,
)
from hpc_ddp.runtime.monitor.usage import USAGE_FIELDS, from_slot, to_slot
from hpc_ddp.runtime.tracking.record import read_tags_set

#: A rank's slot begins with its seconds waiting for data, in forward, in optimizer steps,
#: waiting for the gradients' all-reduce and agreeing on a stop; its machine's figures
#: (:data:`USAGE_FIELDS`) follow.
SLOT_TIMES = 5


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
    # The GPUs earlier attempts found idle stay in the run's tag (kept in its tracking.json).
    earlier = read_tags_set(context.run_dir).get(IDLE_GPUS_TAG, "") if context.env.is_main else ""
    return SystemMonitor(
        context.config.monitor, context.device, context.node, context.control_group,
        context.env.is_main, context.signals.stop_without_requeue, context.tracker.set_tag,
        earlier,
    )  # fmt: skip


@dataclass(frozen=True)
class IntervalReport:
    """One log interval's metrics, summed across ranks in the background, followed by a
    slot per rank: its seconds of waiting for data, in its model's forward, in optimizer
    steps, waiting for the gradients' all-reduce and agreeing on a stop
    (:data:`SLOT_TIMES`), then (with the
    system monitor on) its figures in :data:`USAGE_FIELDS` order."""

    sums: PendingSums
    names: list[str]
    step: int
    epoch: int
    steps: int
    seconds: float
    lr: float | None
    #: False where the loop handed out no batches (run.iterations: the script loads its own).
    data_timed: bool
    #: This rank's seconds in checkpoint stalls and evaluation during the interval.
    checkpoint_s: float
    evaluation_s: float
    #: The FLOPs counted for this rank's training forwards and backwards in the interval
    #: (None: not counted).
    flops: float | None
    #: Seconds of the interval in which this rank's process did not run (left out of
    #: ``seconds``).
    suspended_s: float = 0.0


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
        self._non_finite = NonFiniteWarnings(context.env.is_main)
        self._paces = IntervalPaces(context.config.monitor)
        #: Checkpoint and evaluation seconds where the last interval closed.
        self._paused = (context.times.checkpoint_s, context.times.evaluation_s)
        self._loader_settings = ""
        self._data_timed = True
        self._throughput = run_throughput(context)
        self.system = system_monitor(context)
        self._slot_width = SLOT_TIMES + (len(USAGE_FIELDS) if self.system else 0)
        #: This rank's timers of the step's parts (the loop times the wait for data); last,
        #: as they hook into torch for good until closed.
        self.timers = StepTimers(context.forward, context.gradient_sync, context.device)

    def add(self, name: str, total: torch.Tensor | float, count: torch.Tensor | float) -> None:
        """A training metric's total over ``count`` items (see :meth:`hpc_ddp.Run.log`);
        what can be checked without a device sync is checked (a name once)."""
        if name not in self._checked_names:
            check_logged_name(name)
            self._checked_names.add(name)
        check_logged_value(name, total, count)
        self.interval.add(name, total, count)

    def close(self) -> None:
        """End the progress display and the readings of the machine and of the step."""
        try:
            self.progress.close()
        finally:
            try:
                self.timers.close()
            finally:
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
        self.timers.take()
        self._paused = (self.context.times.checkpoint_s, self.context.times.evaluation_s)

    def _move_interval_to_epoch(self) -> tuple[list[str], torch.Tensor]:
        """The interval's metrics, packed, added to the epoch's (a collective: the names are
        compared across ranks)."""
        self.interval.agree()
        names, local = self.interval.names, self.interval.local()
        for index, name in enumerate(names):
            self.epoch.add(name, local[2 * index], local[2 * index + 1])
        self.interval.clear()
        return names, local

    def close_interval(
        self, step: int, epoch: int, steps: int, seconds: float, suspended_s: float = 0.0
    ) -> None:
        """Start summing this interval's metrics (and every rank's wait for data) across
        ranks; publish the previous one's. ``seconds``: the time the process ran in it, and
        ``suspended_s`` the time it did not.

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
        parts, forward = self.timers.take()
        mine = (*parts, *usage)
        for index, value in enumerate(mine):  # a fill each: a handful per interval
            slots[env.rank, index] = value
        local = torch.cat([local, slots.reshape(-1)])
        lr = self.context.current_lr()
        paused = (self.context.times.checkpoint_s, self.context.times.evaluation_s)
        report = IntervalReport(
            PendingSums(local), names, step, epoch, steps, seconds, lr, self._data_timed,
            paused[0] - self._paused[0], paused[1] - self._paused[1], forward.flops, suspended_s,
        )  # fmt: skip
        self._paused = paused
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
        self._non_finite.observe({name: means[name] for name in counted}, report.step)
        metrics = {f"interval/{name}": value for name, value in means.items()}
        slots = values[2 * len(report.names) :]
        rows = [slots[at : at + self._slot_width] for at in range(0, len(slots), self._slot_width)]
        # The step's parts would count a suspension in whichever one it fell in: none said.
        if self.context.env.is_main and not report.suspended_s:
            metrics.update(self._paces_of(report, rows))
        flops_per_s = counted_flops_per_s(report.flops, self.context.env.world_size, report.seconds)
        steps_per_s = report.steps / max(1e-9, report.seconds)
        dtype = self.context.forward.compute_dtype
        rate, pace = self._throughput.rates(steps_per_s, self.global_batch_size, flops_per_s, dtype)
        metrics.update(pace)
        if self.system and self.context.env.is_main:
            system = self.system.metrics([from_slot(row[SLOT_TIMES:]) for row in rows])
            metrics.update(system)
            rate += gpu_text(system)
        self.progress.update(report.step, report.epoch, means, rate)
        if report.lr is not None:
            metrics["interval/lr"] = report.lr
        self.context.tracker.log_metrics(metrics, report.step)

    def _paces_of(
        self, report: IntervalReport, rows: Sequence[Sequence[float]]
    ) -> dict[str, float]:
        """Rank 0: where the interval's time went (``interval/<part>_percent``, the slowest
        rank), from every rank's slot; the warnings those figures call for are said."""
        times = RankTimes(
            report.seconds,
            [float(row[0]) for row in rows] if report.data_timed else None,
            [float(row[1]) for row in rows] if self.context.forward.timing(main=True) else None,
            timed_per_rank([float(row[2]) for row in rows]),
            report.checkpoint_s,
            report.evaluation_s,
            timed_per_rank([float(row[3]) for row in rows]),
            [float(row[4]) for row in rows],
        )
        hosts = [place.host for place in self.system.places] if self.system else None
        found, said = self._paces.read(times, self._loader_settings, hosts)
        for line in said:
            get_logger().warning(line)
        return {f"interval/{name}": value for name, value in found.items()}

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
            self._non_finite.observe({n: v for n, v in scalars.items() if n in counted}, step)

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
