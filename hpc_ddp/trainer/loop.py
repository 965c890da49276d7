"""The built-in trainer: a classifier trained with cross-entropy, written against the public
API (:func:`hpc_ddp.start`) like any user's script."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping
from typing import Any

import torch
import yaml
from torch import nn

from hpc_ddp import HpcDdpError, Run, Sum, start
from hpc_ddp.runtime.configfile import to_dict
from hpc_ddp.trainer.config import Config, OptimConfig, resume_fingerprint
from hpc_ddp.trainer.datasets import Datasets, ParquetSource, ParquetTrainLoader, build_datasets
from hpc_ddp.trainer.models import StagedMLP, build_model, check_model_takes
from hpc_ddp.trainer.parquet import ParquetLoader
from hpc_ddp.trainer.schedule import LrSchedule

#: Evaluation batches hold at least this many samples per rank.
EVAL_BATCH_MIN = 256


def make_optimizer(optim: OptimConfig, model: nn.Module) -> torch.optim.Optimizer:
    if optim.name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay)
    return torch.optim.SGD(
        model.parameters(), lr=optim.lr, momentum=optim.momentum, weight_decay=optim.weight_decay
    )


def make_loaders(run: Run, config: Config, datasets: Datasets) -> tuple[Any, Any]:
    """(training micro-batches, exact validation batches) for this rank."""
    data, accum = config.data, config.train.grad_accum_steps
    micro = run.micro_batch_size(data.batch_size, accum)
    workers = run.loader_workers(data.num_workers)
    eval_batch = max(micro, EVAL_BATCH_MIN)
    train_set, val_set = datasets.train, datasets.val
    if isinstance(train_set, ParquetSource) and isinstance(val_set, ParquetSource):
        shard = train_set.shard(run.rank, run.world_size, config.run.seed, training=True)
        parquet = ParquetTrainLoader(shard, micro, accum, data.batch_size, workers, run.device)
        val_shard = val_set.shard(run.rank, run.world_size, 0, training=False)
        return parquet, ParquetLoader(val_shard, eval_batch, workers, run.device.type == "cuda")
    assert not isinstance(train_set, ParquetSource) and not isinstance(val_set, ParquetSource)
    train = run.train_loader(
        train_set, data.batch_size, grad_accum_steps=accum, num_workers=workers
    )
    val = run.eval_loader(val_set, eval_batch * run.world_size, num_workers=workers)
    return train, val


def evaluate(run: Run, model: nn.Module, loader: Any, bf16: bool) -> dict[str, Sum]:
    """Loss and accuracy over the WHOLE validation set, summed exactly over all ranks."""
    sums = run.sums()
    model.eval()
    with torch.no_grad(), torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=bf16):
        for features, labels in loader:
            features = features.to(run.device, non_blocking=True)
            labels = labels.to(run.device, non_blocking=True)
            logits = model(features).float()
            loss = nn.functional.cross_entropy(logits, labels, reduction="sum")
            sums.add("loss", loss, len(labels))
            sums.add("accuracy", logits.argmax(dim=1).eq(labels).sum(), len(labels))
    model.train()
    return sums.reduce()


def _refuse_new_world_with_dropout(run: Run, config: Config) -> None:
    resumed = run.resumed
    if resumed and resumed.world_size != run.world_size and config.model.dropout > 0:
        raise HpcDdpError(
            f"the checkpoint was written by {resumed.world_size} ranks, this run has "
            f"{run.world_size}; with model.dropout>0 each rank's random stream matters",
            f"resume with {resumed.world_size} ranks",
        )


def _refuse_empty(datasets: Datasets) -> None:
    train_rows, val_rows = datasets.sizes()
    if train_rows == 0 or val_rows == 0:
        empty = "training" if train_rows == 0 else "validation"
        raise HpcDdpError(
            f"the {empty} set is empty ({train_rows} training, {val_rows} validation samples)",
            "give the trainer samples to train and validate on (data.*); the validation loss "
            "and accuracy are averages over the validation set",
        )


def train(config: Config, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Train as the config says on the ranks the launcher started; returns this rank's
    summary (rank 0 also writes summary.json and model.pt). ``environ``: the launcher's
    environment as :func:`hpc_ddp.start` takes it (default: this process's)."""
    run = start(
        config.runtime,
        environ=environ,
        name=config.run.name,
        params=config.trainer_sections(),
        fingerprint=resume_fingerprint(config),
        log_interval=config.train.log_interval,
    )
    datasets = build_datasets(config)
    _refuse_empty(datasets)
    model = build_model(config, datasets.num_features, datasets.num_classes)
    check_model_takes(model, datasets.first_features(), datasets.num_classes)
    if isinstance(model, StagedMLP):
        model.place(run.devices)
    model = run.wrap(model)
    optimizer = make_optimizer(config.optim, model)
    train_loader, val_loader = make_loaders(run, config, datasets)
    if train_loader.steps_per_epoch == 0:
        raise HpcDdpError(
            "this rank's share of the training set is smaller than one optimizer step "
            f"(the global data.batch_size={config.data.batch_size})",
            "lower data.batch_size or use more training data",
        )
    total_steps = config.train.epochs * train_loader.steps_per_epoch
    if config.train.max_steps is not None:
        total_steps = min(total_steps, config.train.max_steps)
    optim = config.optim
    scheduler = LrSchedule(optimizer, optim.warmup_steps, total_steps, optim.schedule)
    run.register(model=model, optimizer=optimizer, scheduler=scheduler)
    run.resume()
    _refuse_new_world_with_dropout(run, config)
    bf16 = config.train.precision == "bf16"

    def autocast() -> contextlib.AbstractContextManager[Any]:
        if bf16:
            return torch.autocast(run.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    accum, count_correct = config.train.grad_accum_steps, config.train.train_accuracy
    val: dict[str, Sum] = {}
    for _epoch in run.epochs(config.train.epochs, max_steps=config.train.max_steps):
        for features, labels in run.steps(train_loader):
            with run.accumulate(model):
                with autocast():
                    logits = model(features)
                    loss = nn.functional.cross_entropy(logits.float() if bf16 else logits, labels)
                (loss / accum if accum > 1 else loss).backward()
            count = len(labels)
            run.log("train_loss", loss.detach() * count, count)
            if count_correct:
                run.log("train_accuracy", logits.argmax(dim=1).eq(labels).sum(), count)
            if not run.accumulating:
                if optim.grad_clip_norm is not None:
                    run.clip_grad_norm_(model.parameters(), optim.grad_clip_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
        val = evaluate(run, run.unwrap(model), val_loader, bf16)
        _log_epoch(run, val)
    weights = run.full_state_dict(model)  # every rank: a sharded model gathers its weights
    if run.is_main:
        _save_weights(weights, run)
        run.log_text("config.yaml", yaml.safe_dump(to_dict(config)))
    trained = run.train_metrics
    nan = Sum(math.nan, 0)
    return run.finish(
        {
            "train_loss": float(trained.get("train_loss", nan).mean),
            "train_accuracy": float(trained["train_accuracy"].mean) if count_correct else None,
            "val_loss": float(val.get("loss", nan).mean),
            "val_accuracy": float(val.get("accuracy", nan).mean),
            "val_samples": int(val["loss"].count) if val else 0,
        }
    )


def _save_weights(weights: dict[str, torch.Tensor], run: Run) -> None:
    """``model.pt`` in the run directory, whole or not at all (renamed into place)."""
    partial = run.run_dir / "model.pt.partial"
    torch.save(weights, partial)
    os.replace(partial, run.run_dir / "model.pt")


def _log_epoch(run: Run, val: dict[str, Sum]) -> None:
    """The epoch's validation metrics at the global step, beside its training metrics (the
    run shows both on rank 0's terminal)."""
    run.log_metrics({"val_loss": val["loss"], "val_accuracy": val["accuracy"]})
