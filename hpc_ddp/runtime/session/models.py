"""What a run does with the user's models: wrap them (replicate or shard), reach the model
inside, accumulate gradients, clip them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hpc_ddp.runtime.loop.context import RunContext
from hpc_ddp.runtime.session.buckets import check_shardable, check_wrappable, wrap_in_ddp
from hpc_ddp.runtime.session.meta import (
    InitWeights,
    materialise,
    on_meta_device,
    sharded_on_device,
)
from hpc_ddp.runtime.session.rank import RankView
from hpc_ddp.runtime.shards import (
    any_sharded,
    holds_shards,
    innermost_sharded_blocks,
    sharded_blocks,
)


def whole_weights(context: RunContext, model: nn.Module) -> dict[str, torch.Tensor]:
    """See :meth:`ModelView.full_state_dict`."""
    if not holds_shards(model):
        return ModelView.unwrap(model).state_dict()
    from hpc_ddp.runtime.session.sharding import full_weights

    return full_weights(model)


class ModelView(RankView):
    """The model side of :class:`hpc_ddp.Run`."""

    @property
    def accumulating(self) -> bool:
        """See :attr:`hpc_ddp.Run.accumulating`."""
        raise NotImplementedError

    def wrap(
        self, model: nn.Module, *, init_weights: InitWeights | None = None, **ddp_options: Any
    ) -> DistributedDataParallel:
        """``model`` on this rank's device inside DistributedDataParallel; with
        ``dist.strategy=fsdp``, the model itself, sharded over the ranks (FSDP2's
        ``fully_shard`` on each of ``dist.shard_blocks``, then on the whole model), so that
        one switch moves a DDP script to FSDP2. A sharded model has no ``.module``: code
        meant for both reaches the model through :meth:`unwrap`.

        A module already spread over several devices (model parallel inside the rank: its
        parts placed on :attr:`devices`) stays where it is and is wrapped without
        ``device_ids``; feed its inputs to its first device.
        ``ddp_options`` go to DistributedDataParallel (e.g. ``find_unused_parameters``).

        A model built on the meta device (``with torch.device("meta"): model = Net()``) is
        given storage and initialised here: by ``init_weights(model)`` (in place, under
        ``torch.no_grad``), else by the ``reset_parameters()`` of each module holding
        parameters or buffers itself, one module at a time on a whole copy of its own weights
        (the same numbers as the model built whole). With ``dist.strategy=fsdp`` it is
        sharded first, so a rank holds its shards and one module more at most
        (``init_weights`` then sees DTensors; on CPU ranks, where DTensor's random ops would
        give every rank the same shard, the whole model is materialised for it first); under
        DDP each rank materialises the whole model.
        """
        check_wrappable(model, self._context.wrapped)
        on_meta = on_meta_device(model, init_weights)
        settings = self._context.config.dist
        if settings.strategy == "fsdp":
            from hpc_ddp.runtime.session.sharding import shard_model

            check_shardable(ddp_options, self._context.config.checkpoint.save_mode)
            sharded = sharded_on_device(
                model,
                lambda whole: shard_model(
                    whole, self.device, settings.shard_blocks, settings.mixed_precision
                ),
                self.device,
                init_weights if on_meta else None,
                on_meta,
            )
            for block in innermost_sharded_blocks(sharded):
                self._context.forward.attach(block, count_flops=False)
            self._context.wrapped.append(sharded)
            return sharded  # type: ignore[return-value]
        if on_meta:
            materialise(model, self.device, init_weights)
        wrapped = wrap_in_ddp(model, self.device, ddp_options)
        self._context.forward.attach(wrapped.module)
        self._context.gradient_sync.attach(wrapped)
        self._context.wrapped.append(wrapped.module)
        return wrapped

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        """The model inside what :meth:`wrap` returned: DDP's ``.module``; a sharded model
        is its own."""
        return model.module if isinstance(model, DistributedDataParallel) else model

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's whole state dict, for a file of weights: of a replicated model, its
        own; of a sharded one, gathered on rank 0's CPU (a collective: call it on every
        rank; the others get {})."""
        return whole_weights(self._context, model)

    def accumulate(self, model: nn.Module) -> AbstractContextManager[Any]:
        """Gradient accumulation in one context: while :attr:`accumulating` (a micro-batch
        that is not the last of its optimizer step) DDP's gradient all-reduce is skipped
        (FSDP2's reduce-scatter too, and its parameters stay gathered); take the optimizer
        step when it is not::

            for batch in run.steps(loader, grad_accum_steps=4):
                with run.accumulate(model):
                    (loss_of(model, batch) / 4).backward()
                if not run.accumulating:
                    optimizer.step()
                    optimizer.zero_grad()
        """
        if self.accumulating and isinstance(model, DistributedDataParallel):
            return model.no_sync()
        blocks = sharded_blocks(model) if self.accumulating else []
        if blocks:
            from hpc_ddp.runtime.session.sharding import accumulating

            return accumulating(blocks)
        return contextlib.nullcontext()

    def clip_grad_norm_(
        self,
        parameters: Iterable[torch.Tensor] | torch.Tensor,
        max_norm: float,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` that is also right for a sharded model
        (``dist.strategy=fsdp``, or one sharded with your own ``fully_shard`` calls): the
        norm is over the whole gradient, not this rank's shard; returns it, the same on every
        rank."""
        kept = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if not any_sharded(kept):  # no DTensor gradients: torch's own, no FSDP import
            return torch.nn.utils.clip_grad_norm_(kept, max_norm, norm_type)
        from hpc_ddp.runtime.session.sharding import clip_grad_norm_

        return clip_grad_norm_(kept, max_norm, norm_type)

    no_sync = accumulate
