"""The training loop: sharded DDP steps, exact cross-rank metrics, checkpoints, clean stops.

Metrics are kept as device tensors and reduced only at log intervals, epoch ends and saves,
so the hot loop has no host synchronisation; the periodic stop agreement runs on a CPU group
in the background (see :class:`~hpc_ddp.preempt.StepAgreement`).
"""

from __future__ import annotations

import gc
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from hpc_ddp.checkpoint import FORMAT_VERSION, checkpoint_dir, save_checkpoint
from hpc_ddp.config import Config
from hpc_ddp.data import Datasets, eval_loader, train_loader
from hpc_ddp.errors import HpcDdpError
from hpc_ddp.logs import Progress, get_logger
from hpc_ddp.metrics import PendingSums, Totals
from hpc_ddp.plan import RunPlan
from hpc_ddp.preempt import StepAgreement, StopSignals
from hpc_ddp.schedule import LrSchedule
from hpc_ddp.tracking import Tracker

#: The stop-signal check period the automatic setting aims at, and its upper bound in steps.
CHECK_PERIOD_S = 1.0
CHECK_EVERY_MAX = 1000
#: With train.log_interval=null: the first log step, then the period aimed at and its bound.
FIRST_LOG_INTERVAL = 20
LOG_PERIOD_S = 5.0
LOG_INTERVAL_MAX = 10000


def make_optimizer(config: Config, model: nn.Module) -> torch.optim.Optimizer:
    optim = config.optim
    if optim.name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay)
    return torch.optim.SGD(
        model.parameters(), lr=optim.lr, momentum=optim.momentum, weight_decay=optim.weight_decay
    )


def weights_sha256(model: nn.Module) -> str:
    """A fingerprint of the state_dict: names, dtypes, shapes and bytes, in sorted order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        value = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}".encode())
        digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


def replica_fingerprint(model: nn.Module) -> torch.Tensor:
    """One exact integer per state_dict entry: the sum of its bits, on the CPU.

    Integer sums are order-independent, so equal tensors give equal numbers whatever the
    device or thread count, and a change of one bit in one element changes its number."""
    sums = []
    for tensor in model.state_dict().values():
        flat = tensor.detach().contiguous().view(-1)
        if flat.numel() == 0:
            sums.append(torch.zeros((), dtype=torch.int64, device=flat.device))
            continue
        as_bits = flat.view(torch.int32) if flat.element_size() == 4 else flat.view(torch.uint8)
        sums.append(as_bits.sum(dtype=torch.int64))
    return torch.stack(sums).cpu()


def diverged_replicas(
    model: nn.Module, world_size: int, group: Any | None
) -> list[tuple[int, str]]:
    """(rank, first differing state_dict entry) for every rank whose weights differ from rank
    0's; empty when all replicas are equal (a collective every rank must call)."""
    if world_size == 1 or not dist.is_initialized():
        return []
    mine = replica_fingerprint(model)
    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine, group=group)
    names = list(model.state_dict())
    diverged = []
    for rank, theirs in enumerate(every[1:], start=1):
        differs = (theirs != every[0]).nonzero()
        if len(differs):
            diverged.append((rank, names[int(differs[0])]))
    return diverged


def evaluate(
    model: nn.Module, loader: DataLoader[Any], device: torch.device, bf16: bool
) -> tuple[float, float, int]:
    """Loss, accuracy and count over the WHOLE validation set, reduced across ranks."""
    totals = Totals.zeros(device)
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        for features, labels in loader:
            features = features.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            logits = model(features).float()
            totals.add(logits, labels, nn.functional.cross_entropy(logits, labels))
    model.train()
    return totals.reduced()


@dataclass(frozen=True)
class IntervalReport:
    """One log interval's metrics, summed across ranks in the background."""

    sums: PendingSums
    step: int
    epoch: int
    lr: float
    seconds: float


@dataclass
class LoopState:
    """Where the loop is; what a checkpoint and the summary record."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    train_time_s: float = 0.0
    last_train: tuple[float, float, int] = (float("nan"), float("nan"), 0)
    last_val: tuple[float, float, int] = (float("nan"), float("nan"), 0)
    resumed_from_step: int | None = None
    #: Set when a stop signal ended the run early (after its checkpoint).
    stopped: bool = False
    last_checkpoint_step: int = -1
    last_save_time: float = field(default_factory=time.monotonic)
    #: Wall-clock time (Unix) of this process's first finished optimizer step.
    first_step_unix: float | None = None
    #: The first step after which some rank's weights differed from rank 0's (None: never).
    replicas_diverged_at: int | None = None


class Trainer:
    """DDP training for one rank under a resolved :class:`RunPlan`."""

    def __init__(
        self,
        config: Config,
        plan: RunPlan,
        datasets: Datasets,
        model: nn.Module,
        tracker: Tracker,
        signals: StopSignals | None = None,
        control_group: Any | None = None,
    ) -> None:
        self.config = config
        self.plan = plan
        self.tracker = tracker
        self.signals = signals
        self.control_group = control_group
        self.device = torch.device(plan.device.device)
        env = plan.dist_env
        pin = self.device.type == "cuda"
        self.loader, self.sampler = train_loader(
            datasets.train,
            env.rank,
            env.world_size,
            plan.micro_batch_size,
            config.run.seed,
            plan.num_workers,
            pin,
        )
        self.val_loader = eval_loader(
            datasets.val,
            env.rank,
            env.world_size,
            max(plan.micro_batch_size, 256),
            plan.num_workers,
            pin,
        )
        self.steps_per_epoch = len(self.loader) // plan.grad_accum_steps
        if self.steps_per_epoch == 0:
            raise HpcDdpError(
                f"this rank's share of the training set is smaller than one micro-batch "
                f"({plan.micro_batch_size} of the global data.batch_size="
                f"{plan.global_batch_size})",
                "lower data.batch_size or use more training data",
            )
        self.total_steps = config.train.epochs * self.steps_per_epoch
        if config.train.max_steps is not None:
            self.total_steps = min(self.total_steps, config.train.max_steps)
        module = model.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        self.model = DistributedDataParallel(module, device_ids=device_ids)
        self.optimizer = make_optimizer(config, self.model)
        self.scheduler = LrSchedule(
            self.optimizer, config.optim.warmup_steps, self.total_steps, config.optim.schedule
        )
        self.state = LoopState()
        self.bf16 = config.train.precision == "bf16"
        self.count_correct = config.train.train_accuracy
        self.grad_clip_norm = config.optim.grad_clip_norm
        # On CPU the loader's tensors are already where the model is: skip the no-op copies,
        # each of which is still a dispatch in the hot loop.
        self._move_batches = self.device.type != "cpu"
        self.epoch_totals = Totals.zeros(self.device)
        self.interval_totals = Totals.zeros(self.device)
        self.check_every = config.preempt.check_every_steps or 1
        self.progress = Progress(self.total_steps, enabled=False)
        self._pending_report: IntervalReport | None = None
        self.log_interval = config.train.log_interval or FIRST_LOG_INTERVAL
        self._calibrated = (
            config.preempt.check_every_steps is not None and config.train.log_interval is not None
        )
        self._interval_steps = 0

    # -- checkpoints -------------------------------------------------------------------------

    def _gather_rng(self) -> dict[str, list[torch.Tensor] | None]:
        """Every rank's RNG states (per-rank streams drive dropout), gathered for rank 0."""
        mine = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            mine["cuda"] = torch.cuda.get_rng_state(self.device)
        gathered: dict[str, list[torch.Tensor] | None] = {"cpu": None, "cuda": None}
        for kind, state in mine.items():
            parts = [torch.empty_like(state) for _ in range(self.plan.dist_env.world_size)]
            if dist.is_initialized() and self.plan.dist_env.world_size > 1:
                dist.all_gather(parts, state, group=self.control_group)
            else:
                parts = [state]
            gathered[kind] = parts
        return gathered

    def checkpoint_state(
        self, mlflow_run_id: str | None, fingerprint: dict[str, str]
    ) -> dict[str, Any]:
        """Everything a resume needs (collective: every rank calls it, rank 0 writes it)."""
        return {
            "format": FORMAT_VERSION,
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": None,
            "epoch": self.state.epoch,
            "step_in_epoch": self.state.step_in_epoch,
            "global_step": self.state.global_step,
            "train_time_s": self.state.train_time_s,
            "world_size": self.plan.dist_env.world_size,
            "rng": self._gather_rng(),
            "totals": {
                "epoch": self.epoch_totals.global_sums().cpu(),
                "interval": self.interval_totals.global_sums().cpu(),
            },
            "mlflow_run_id": mlflow_run_id,
            "fingerprint": fingerprint,
            "restart_count": self.plan.dist_env.restart_count,
        }

    def save(self, reason: str, fingerprint: dict[str, str]) -> None:
        """Rank 0 writes; all ranks wait until the file is in place."""
        self._publish_interval()
        if (
            not self.config.checkpoint.enabled
            or self.state.last_checkpoint_step == self.state.global_step
        ):
            return
        self.check_replicas()
        state = self.checkpoint_state(self.tracker.run_id, fingerprint)
        if self.plan.dist_env.is_main:
            started = time.perf_counter()
            path = save_checkpoint(
                state,
                checkpoint_dir(self.plan.run_dir),
                self.state.global_step,
                self.config.checkpoint.keep_last,
            )
            get_logger().info(
                f"checkpoint ({reason}) step {self.state.global_step}: {path} "
                f"({time.perf_counter() - started:.2f} s)"
            )
        if dist.is_initialized():
            dist.barrier(group=self.control_group)
        self.state.last_checkpoint_step = self.state.global_step
        self.state.last_save_time = time.monotonic()

    def check_replicas(self) -> None:
        """Compare every rank's weights with rank 0's; report the first divergence loudly.

        DDP keeps replicas equal only while every rank applies the same update; a checkpoint
        and model.pt hold rank 0's weights alone, so a divergence is named here, not hidden."""
        diverged = diverged_replicas(
            self.model.module, self.plan.dist_env.world_size, self.control_group
        )
        if not diverged or self.state.replicas_diverged_at is not None:
            return
        self.state.replicas_diverged_at = self.state.global_step
        if self.plan.dist_env.is_main:
            ranks = ", ".join(f"rank {rank} ({name})" for rank, name in diverged)
            get_logger().error(
                f"model replicas differ from rank 0's at step {self.state.global_step}: "
                f"{ranks}; checkpoints and model.pt hold rank 0's weights. HINT: DDP keeps "
                "replicas equal only when every rank makes the same update: look for "
                "parameters or buffers changed outside the optimizer on some ranks only "
                "(in-place edits, rank-dependent branches, buffers not broadcast)"
            )

    def restore(self, saved: dict[str, Any]) -> None:
        """Continue exactly where the checkpoint left off (same weights, data position, RNG)."""
        env = self.plan.dist_env
        self.model.module.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.state.epoch = int(saved["epoch"])
        self.state.step_in_epoch = int(saved["step_in_epoch"])
        self.state.global_step = int(saved["global_step"])
        self.state.train_time_s = float(saved["train_time_s"])
        self.state.resumed_from_step = self.state.global_step
        self.state.last_checkpoint_step = self.state.global_step
        if env.is_main:  # the saved sums are global: one rank carries them
            self.epoch_totals.values += saved["totals"]["epoch"].to(self.device)
            self.interval_totals.values += saved["totals"]["interval"].to(self.device)
        rng = saved["rng"]
        if saved["world_size"] == env.world_size:
            torch.set_rng_state(rng["cpu"][env.rank])
            if self.device.type == "cuda" and rng.get("cuda"):
                torch.cuda.set_rng_state(rng["cuda"][env.rank], self.device)
        elif self.config.model.dropout > 0:
            raise HpcDdpError(
                f"the checkpoint was written by {saved['world_size']} ranks, this run has "
                f"{env.world_size}; with model.dropout>0 each rank's random stream matters",
                f"resume with {saved['world_size']} ranks",
            )

    # -- the loop ----------------------------------------------------------------------------

    def _optimizer_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One optimizer step over ``grad_accum_steps`` micro-batches; all-reduce on the last."""
        divisor = len(micro_batches)
        for features, labels in micro_batches[:-1]:
            with self.model.no_sync():
                self._forward_backward(features, labels, divisor)
        self._forward_backward(*micro_batches[-1], divisor)
        if self.grad_clip_norm is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _forward_backward(self, features: torch.Tensor, labels: torch.Tensor, divisor: int) -> None:
        if self._move_batches:
            features = features.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
        if self.bf16:
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                logits = self.model(features).float()
                loss = nn.functional.cross_entropy(logits, labels)
        else:
            logits = self.model(features)
            loss = nn.functional.cross_entropy(logits, labels)
        (loss / divisor if divisor > 1 else loss).backward()
        self.interval_totals.add(logits, labels, loss, self.count_correct)

    def _calibrate_periods(self, elapsed_s: float) -> None:
        """Agree the periods left automatic: stop-signal checks about once per second and
        log steps about every LOG_PERIOD_S seconds of training.

        Rank 0's measured step rate decides and is broadcast, so every rank checks and logs at
        the same steps (both are collectives)."""
        steps_per_s = self._interval_steps / max(1e-9, elapsed_s)

        def steps_for(seconds: float, most: int) -> int:
            return max(1, min(most, round(steps_per_s * seconds)))

        periods = torch.tensor(
            [
                self.config.preempt.check_every_steps or steps_for(CHECK_PERIOD_S, CHECK_EVERY_MAX),
                self.config.train.log_interval or steps_for(LOG_PERIOD_S, LOG_INTERVAL_MAX),
            ]
        )
        if dist.is_initialized() and self.plan.dist_env.world_size > 1:
            dist.broadcast(periods, src=0, group=self.control_group)
        self.check_every, self.log_interval = (int(value) for value in periods.tolist())
        self._calibrated = True
        if self.plan.dist_env.is_main:
            get_logger().info(
                f"stop signals are checked every {self.check_every} step(s); progress and "
                f"interval metrics every {self.log_interval} step(s)"
            )

    def _log_interval(self, started: float) -> None:
        """Start summing this interval's metrics across ranks; publish the previous one's.

        The all-reduce runs in the background until the next log step, so no rank waits for
        the others here and a GPU is never synchronised; each interval's line and metrics
        appear one interval late, under their own step."""
        if not self._calibrated:
            self._calibrate_periods(time.perf_counter() - started)
        self._interval_steps = 0
        report = IntervalReport(
            PendingSums(self.interval_totals.local_sums()),
            self.state.global_step,
            self.state.epoch,
            self.scheduler.lr,
            time.perf_counter() - started,
        )
        self.epoch_totals.absorb(self.interval_totals)
        self.interval_totals = Totals.zeros(self.device)
        self._publish_interval()
        self._pending_report = report

    def _publish_interval(self) -> None:
        """Log the interval whose sums are on their way (if any): progress line and metrics."""
        report, self._pending_report = self._pending_report, None
        if report is None:
            return
        loss_sum, correct, count = report.sums.result()
        loss = loss_sum / count if count else float("nan")
        samples_per_s = count / max(1e-9, report.seconds)
        self.progress.update(report.step, report.epoch, loss, samples_per_s)
        metrics = {
            "interval/train_loss": loss,
            "interval/samples_per_s": samples_per_s,
            "lr": report.lr,
        }
        if self.count_correct:
            metrics["interval/train_accuracy"] = correct / count if count else float("nan")
        self.tracker.log_metrics(metrics, report.step)

    def _save_due_by_time(self) -> bool:
        minutes = self.config.checkpoint.every_minutes
        if minutes is None or not self.plan.dist_env.is_main:
            return False
        return time.monotonic() - self.state.last_save_time >= minutes * 60

    def _run_epoch(self, agreement: StepAgreement, fingerprint: dict[str, str]) -> None:
        """Steps until the epoch ends, the run reaches total_steps, or the ranks agree to stop."""
        accum = self.plan.grad_accum_steps
        every_steps = self.config.checkpoint.every_steps
        self.sampler.set_start(self.state.step_in_epoch * self.plan.micro_batch_size * accum)
        interval_started = time.perf_counter()
        self._interval_steps = 0
        micro: list[tuple[torch.Tensor, torch.Tensor]] = []
        for batch in self.loader:
            if self.state.global_step >= self.total_steps:
                return
            micro.append(batch)
            if len(micro) < accum:
                continue
            self._optimizer_step(micro)
            micro = []
            if self.state.first_step_unix is None:
                self.state.first_step_unix = time.time()
            self.state.global_step += 1
            self.state.step_in_epoch += 1
            self._interval_steps += 1
            if self.state.global_step % self.log_interval == 0:
                self._log_interval(interval_started)
                interval_started = time.perf_counter()
            stop, save_now = False, False
            if self.state.global_step % self.check_every == 0:
                stop, save_now = agreement.exchange(
                    self.signals is not None and self.signals.requested, self._save_due_by_time()
                )
            if stop:
                self.state.stopped = True
                self.save("stop signal", fingerprint)
                return
            if save_now or (every_steps and self.state.global_step % every_steps == 0):
                self.save("periodic", fingerprint)
            if self.state.global_step >= self.total_steps:
                return

    def _end_epoch(self) -> None:
        self._publish_interval()
        self.epoch_totals.absorb(self.interval_totals)
        self.interval_totals = Totals.zeros(self.device)
        train_loss, train_acc, train_count = self.epoch_totals.reduced()
        if not self.count_correct:
            train_acc = float("nan")
        self.state.last_train = (train_loss, train_acc, train_count)
        self.epoch_totals = Totals.zeros(self.device)
        self.state.last_val = evaluate(self.model.module, self.val_loader, self.device, self.bf16)
        self.state.epoch += 1
        self.state.step_in_epoch = 0
        val_loss, val_acc, val_count = self.state.last_val
        train_acc_text = f" train_acc {train_acc:.4f}" if self.count_correct else ""
        if self.plan.dist_env.is_main:
            get_logger().info(
                f"epoch {self.state.epoch} step {self.state.global_step} train_loss "
                f"{train_loss:.4f}{train_acc_text} val_loss {val_loss:.4f} "
                f"val_acc {val_acc:.4f} (val samples {val_count})"
            )
        metrics = {"train_loss": train_loss, "val_loss": val_loss, "val_accuracy": val_acc}
        if self.count_correct:
            metrics["train_accuracy"] = train_acc
        self.tracker.log_metrics(metrics, self.state.epoch)

    def fit(self, fingerprint: dict[str, str]) -> LoopState:
        """Train all epochs (or until train.max_steps, or a stop signal), validating after each."""
        self.progress = Progress(self.total_steps, enabled=self.plan.dist_env.is_main)
        agreement = StepAgreement(self.control_group if self.plan.dist_env.world_size > 1 else None)
        self.model.train()
        # Everything alive now (modules, model, data) lives for the whole run: keep the cyclic
        # garbage collector from rescanning it during training.
        gc.freeze()
        try:
            while self.state.global_step < self.total_steps or self.state.step_in_epoch:
                self.sampler.set_epoch(self.state.epoch)
                started = time.perf_counter()
                self._run_epoch(agreement, fingerprint)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the epoch's queued kernels count too
                self.state.train_time_s += time.perf_counter() - started
                if self.state.stopped:
                    break
                epoch_done = self.state.step_in_epoch >= self.steps_per_epoch
                if epoch_done or self.state.global_step >= self.total_steps:
                    self._end_epoch()
        finally:
            agreement.close()
            self.progress.close()
        if not self.state.stopped:
            self.save("end of training", fingerprint)
        if self.state.last_checkpoint_step != self.state.global_step:
            self.check_replicas()  # not checked by a save at this step
        return self.state

    def summary(self, wall_time_s: float) -> dict[str, Any]:
        """The facts summary.json records; identical on every rank except timings."""
        env = self.plan.dist_env
        state = self.state
        samples_seen = state.global_step * self.plan.global_batch_size
        return {
            "world_size": env.world_size,
            "num_nodes": env.num_nodes,
            "launcher": env.launcher,
            "job_id": env.job_id,
            "restart_count": env.restart_count,
            "resumed_from_step": state.resumed_from_step,
            "stopped_early": state.stopped,
            "device": self.plan.device.device,
            "backend": self.plan.device.backend,
            "epochs": state.epoch,
            "global_step": state.global_step,
            "samples_seen": samples_seen,
            "train_loss": state.last_train[0],
            "train_accuracy": state.last_train[1] if self.count_correct else None,
            "val_loss": state.last_val[0],
            "val_accuracy": state.last_val[1],
            "val_samples": state.last_val[2],
            "wall_time_s": round(wall_time_s, 3),
            "train_time_s": round(state.train_time_s, 3),
            "samples_per_s": round(samples_seen / max(1e-9, state.train_time_s), 1),
            "weights_sha256": weights_sha256(self.model.module),
            "replicas_in_sync": state.replicas_diverged_at is None,
            "replicas_diverged_at": state.replicas_diverged_at,
            "torch_threads": torch.get_num_threads(),
            "first_step_unix": state.first_step_unix,
        }
