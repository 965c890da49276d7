"""Where a run's rank is and its share of the data: the part of :class:`hpc_ddp.Run` that
needs nothing of the training loop."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils.data import Dataset

from hpc_ddp.runtime.arguments import sized_dataset, whole_number
from hpc_ddp.runtime.config import RuntimeConfig
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.loop.context import RunContext
from hpc_ddp.runtime.loop.data import TrainLoader
from hpc_ddp.runtime.place.env import DistEnv, available_cpus
from hpc_ddp.runtime.place.plan import micro_batch_size, resolve_num_workers
from hpc_ddp.runtime.session.evaluation import EvalBatches, eval_loader
from hpc_ddp.runtime.shards import holds_shards


class RankView:
    """This rank's place in the job (rank, device, run directory) and the loaders of its
    share of a dataset; :class:`hpc_ddp.Run` is one."""

    def __init__(self, context: RunContext) -> None:
        self._context = context

    @property
    def env(self) -> DistEnv:
        """This rank's place in the job, resolved once from the launcher's environment."""
        return self._context.env

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        """Rank 0: the rank that logs, tracks and writes files."""
        return self.env.is_main

    @property
    def device(self) -> torch.device:
        """This rank's device: ``cuda:LOCAL_RANK`` (or ``cuda:0`` with one GPU per task), else
        the CPU; already selected with ``torch.cuda.set_device``."""
        return self._context.device

    @property
    def devices(self) -> list[torch.device]:
        """Every device this rank drives, :attr:`device` first: one, or ``dist.gpus_per_rank``
        GPUs for a model split over several (place its parts there, then :meth:`wrap` it)."""
        return [torch.device(name) for name in self._context.plan.device.devices]

    @property
    def job_id(self) -> str:
        """The Slurm job id (stable across requeues), or the launcher's run id."""
        return self.env.job_id

    @property
    def run_dir(self) -> Path:
        """<output_dir>/<name>/<id>: checkpoints, summary.json; the same across requeues."""
        return self._context.run_dir

    @property
    def config(self) -> RuntimeConfig:
        return self._context.config

    # -- this rank's data -------------------------------------------------------------------

    def train_loader(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        *,
        grad_accum_steps: int = 1,
        num_workers: int | Literal["auto"] = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        shuffle: bool = True,
        **dataloader_options: Any,
    ) -> TrainLoader:
        """This rank's share of ``dataset`` for :meth:`steps`.

        ``batch_size`` is GLOBAL: samples per optimizer step over all ranks; each rank loads
        ``batch_size / (world_size * grad_accum_steps)`` per micro-batch, and a batch that
        does not divide is refused naming the world sizes that work. Only full batches:
        every step holds exactly ``batch_size`` samples at any world size. Batches (tensors,
        tuples, dicts, nested) arrive on :attr:`device`. ``num_workers="auto"``: this
        rank's CPUs minus one. Other options go to DataLoader.
        """
        samples = sized_dataset(dataset, "run.train_loader")
        batch_size = whole_number(batch_size, "run.train_loader(batch_size)")
        grad_accum_steps = whole_number(grad_accum_steps, "run.train_loader(grad_accum_steps)")
        if samples < batch_size:
            raise HpcDdpError(
                f"run.train_loader: the dataset holds {samples} sample(s), fewer than one "
                f"global batch of {batch_size}: an epoch would have no step",
                "pass a smaller batch_size (the GLOBAL batch over all ranks), or more data",
            )
        return TrainLoader(
            dataset,
            rank=self.rank,
            world_size=self.world_size,
            global_batch_size=batch_size,
            grad_accum_steps=grad_accum_steps,
            seed=self.config.run.seed,
            num_workers=self.loader_workers(num_workers),
            device=self.device,
            collate_fn=collate_fn,
            shuffle=shuffle,
            **dataloader_options,
        )

    def eval_loader(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        *,
        num_workers: int | Literal["auto"] = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        **dataloader_options: Any,
    ) -> Any:
        """Every sample of ``dataset`` exactly once over all ranks (no padding, nothing
        dropped), in batches of about ``batch_size / world_size`` per rank. Sum with
        :meth:`sums` for exact results. With a sharded model (``dist.strategy=fsdp``, or
        one you shard yourself and register before the first evaluation) every rank gets as
        many batches (a shorter share ends with an empty batch: 0 samples), since each
        forward pass of a sharded model needs every rank."""
        sized_dataset(dataset, "run.eval_loader")
        batch_size = whole_number(batch_size, "run.eval_loader(batch_size)")
        workers = self.loader_workers(num_workers)

        def build(same_count: bool) -> Any:
            return eval_loader(
                dataset,
                rank=self.rank,
                world_size=self.world_size,
                batch_size=max(1, batch_size // self.world_size),
                num_workers=workers,
                device=self.device,
                collate_fn=collate_fn,
                same_count=same_count,
                **dataloader_options,
            )

        return EvalBatches(build, self._holds_shards, self._context.times)

    def _holds_shards(self) -> bool:
        """The run trains a sharded model: run.wrap shards, or a registered one is."""
        context = self._context
        return context.config.dist.strategy == "fsdp" or any(
            holds_shards(value) for value in [*context.wrapped, *context.registry.objects.values()]
        )

    def loader_workers(self, setting: int | Literal["auto"] = "auto") -> int:
        """DataLoader workers for this rank, for a loader of your own: ``"auto"`` is this
        rank's share of the task's CPUs minus one; a number is kept."""
        if setting != "auto":
            setting = whole_number(setting, "num_workers", minimum=0)
        return resolve_num_workers(
            setting, self.env.cpus_per_task, available_cpus(), self.env.local_world_size
        )

    def micro_batch_size(self, batch_size: int, grad_accum_steps: int = 1) -> int:
        """Samples per micro-batch on this rank for a GLOBAL ``batch_size`` (samples per
        optimizer step over all ranks), for a loader of your own; a batch that does not
        divide over ``world_size x grad_accum_steps`` is refused naming the world sizes that
        work."""
        return micro_batch_size(batch_size, self.world_size, grad_accum_steps)
