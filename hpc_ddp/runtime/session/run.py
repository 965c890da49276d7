"""The run a user's script holds: :class:`Run`, made by :func:`hpc_ddp.start`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any

import torch

from hpc_ddp.runtime.arguments import optional_whole_number, whole_number
from hpc_ddp.runtime.checkpoint.files import Found
from hpc_ddp.runtime.checkpoint.loading import Resumed
from hpc_ddp.runtime.errors import HpcDdpError, Stopped
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.loop.context import RunContext
from hpc_ddp.runtime.loop.data import StepLoader, step_source
from hpc_ddp.runtime.loop.intervals import metric_text
from hpc_ddp.runtime.loop.logged import logged_step
from hpc_ddp.runtime.loop.metrics import Sum, Sums, scalar_metrics
from hpc_ddp.runtime.loop.steps import StepLoop
from hpc_ddp.runtime.loop.streams import Ticks
from hpc_ddp.runtime.monitor.timeline import mark
from hpc_ddp.runtime.names import check_name
from hpc_ddp.runtime.session.buckets import check_registrable, settle_own_ddp
from hpc_ddp.runtime.session.ending import Ending
from hpc_ddp.runtime.session.finishing import end_already_finished, finish_run
from hpc_ddp.runtime.session.misuse import BreakNote, after_finish, nested_steps, registered_late
from hpc_ddp.runtime.session.models import ModelView

__all__ = ["Run"]


class Run(ModelView):
    """One training run on this rank; made by :func:`hpc_ddp.start`, never directly.

    Add a few calls to a plain PyTorch loop::

        run = hpc_ddp.start()
        model = run.wrap(model)                       # DDP on this rank's device
        optimizer = torch.optim.AdamW(model.parameters())
        loader = run.train_loader(dataset, batch_size=256)   # the GLOBAL batch
        run.register(model=model, optimizer=optimizer)       # checkpointed and resumed
        for epoch in run.epochs(10):                  # a resumed run starts where it stopped
            for batch in run.steps(loader):           # stops, saves and requeues between steps
                loss = compute_loss(model, batch)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                run.log("loss", loss.detach() * len(batch), len(batch))
        run.finish()
    """

    def __init__(
        self,
        context: RunContext,
        loop: StepLoop,
        ending: Ending,
        resume: Found | None,
        started: float,
        timeline: dict[str, float],
    ) -> None:
        super().__init__(context)
        self._loop = loop
        self._ending = ending
        self._resume = resume
        self._resume_done = False
        self._finished = False
        #: Inside a loop over run.steps() (or run.iterations()).
        self._stepping = False
        self._break_note = BreakNote(self.is_main)
        self._started = started
        self._timeline = timeline
        self.resumed: Resumed | None = None
        """The checkpoint this run resumed from, once :meth:`resume` ran (None: a fresh run)."""

    @property
    def epoch(self) -> int:
        """The current epoch (0-based)."""
        return self._loop.position.epoch

    @property
    def global_step(self) -> int:
        """Optimizer steps done so far, over all attempts of the run."""
        return self._loop.position.global_step

    @property
    def accumulating(self) -> bool:
        """True while :meth:`steps` hands out a micro-batch that is not the last of its
        optimizer step (gradient accumulation): skip ``optimizer.step()`` then."""
        return self._loop.accumulating

    @property
    def train_metrics(self) -> dict[str, Sum]:
        """The last finished epoch's :meth:`log` metrics, summed over all ranks."""
        return self._loop.metrics.epoch_metrics

    @property
    def state(self) -> dict[str, Any]:
        """Plain values saved in every checkpoint and restored on resume, no wrapper needed:
        numbers, strings, bools, None, tensors and lists/dicts of them (e.g.
        ``run.state["best_val_loss"] = 1e9``). Rank 0's values are saved; a resume gives
        them to every rank when training begins (read them through ``run.state`` after
        :meth:`resume`)."""
        return self._context.values

    # -- checkpoints -------------------------------------------------------------------------

    def register(self, **objects: Any) -> None:
        """Save these objects in every checkpoint and restore them on resume: anything with
        ``state_dict()`` and ``load_state_dict()`` (models, optimizers, schedulers, your
        own). Register before :meth:`resume` (or the first :meth:`epochs`). A model you shard
        with your own ``fully_shard`` calls is registered as it is, without :meth:`wrap`."""
        if self._resume_done:
            raise registered_late(f"register({', '.join(objects)})")
        checkpoints = self._context.config.checkpoint
        check_registrable(objects, checkpoints.save_mode if checkpoints.enabled else None)
        # A DDP the script built sums gradients in the order run.wrap's does, from its first
        # step, so a resumed attempt sums as the uninterrupted one (bitwise at 3+ ranks).
        settle_own_ddp(objects, self._context.wrapped)
        self._context.registry.add(objects)

    def register_per_rank(self, **objects: Any) -> None:
        """Like :meth:`register`, for state that differs from rank to rank (a replay buffer,
        a cursor into this rank's own data, a generator of your own): each rank's copy is
        saved under its own key, and a resume gives each rank its own back. Register the
        same names on every rank. A resume on another number of ranks is refused: such
        state cannot be split or merged."""
        if self._resume_done:
            raise registered_late(f"register_per_rank({', '.join(objects)})")
        self._context.registry.add(objects, per_rank=True)

    def resume(self) -> Resumed | None:
        """Restore the registered objects, the position and every rank's random streams from
        the newest good checkpoint of this run, if there is one (also done by the first
        :meth:`epochs` or :meth:`steps`). Returns what it resumed from."""
        if not self._resume_done:
            self._resume_done = True
            self.resumed = self._loop.checkpointer.resume(self._resume)
            self._resume = None
        return self.resumed

    # -- the loop ----------------------------------------------------------------------------

    def epochs(
        self, num_epochs: int | None = None, *, max_steps: int | None = None
    ) -> Iterator[int]:
        """The epochs left: a resumed run starts at its saved epoch. ``max_steps`` ends the
        run after that many optimizer steps (over all attempts); None: no limit."""
        self._refuse_after_finish("run.epochs()")
        loop = self._loop
        loop.limits.set(
            num_epochs=optional_whole_number(num_epochs, "run.epochs(num_epochs)"),
            max_steps=optional_whole_number(max_steps, "run.epochs(max_steps)"),
        )
        loop.begin(self.resume)
        if (
            self.resumed is not None
            and self.resumed.finished
            and not loop.limits.more_epochs(loop.position)
        ):
            end_already_finished(self._context, self._ending, self.resumed)
        mark(self._timeline, "training")
        yield from loop.epochs()

    def steps(
        self,
        loader: StepLoader | Iterable[Any],
        *,
        grad_accum_steps: int | None = None,
        max_steps: int | None = None,
    ) -> Iterator[Any]:
        """The current epoch's micro-batches from where the run stands.

        ``loader``: :meth:`train_loader` (a resumed run skips the samples already trained
        on, without loading them) or any iterable of batches: your own DataLoader (with your
        own sampler), a StatefulDataLoader, an endless generator. How each kind resumes is
        in :mod:`hpc_ddp.runtime.loop.streams` and is said once at a resume; an iterable's
        batches are handed out as they come (move them to :attr:`device` yourself).
        ``grad_accum_steps``: micro-batches per optimizer step for an iterable
        (train_loader's own otherwise). ``max_steps``: end after that many optimizer steps
        over all attempts (like :meth:`epochs`'s).

        Between optimizer steps it does what the run needs: interval metrics, the stop all
        ranks agree on (checkpoint, then requeue or exit, raising :class:`hpc_ddp.Stopped`),
        periodic and requested checkpoints. Call ``optimizer.step()`` once per step, i.e.
        when not :attr:`accumulating`. Without :meth:`epochs`, each call is the next epoch
        (an endless iterable is one epoch)."""
        self._refuse_after_finish("run.steps()")
        if self._stepping:
            raise nested_steps()
        self._break_note.say()
        source = step_source(
            loader, optional_whole_number(grad_accum_steps, "run.steps(grad_accum_steps)")
        )
        if max_steps is not None:
            self._loop.limits.set(max_steps=whole_number(max_steps, "run.steps(max_steps)"))
        self._loop.begin(self.resume)
        mark(self._timeline, "training")
        return self._ended_on_stop(self._loop.steps(source))

    def _refuse_after_finish(self, what: str) -> None:
        if self._finished:
            raise after_finish(what)

    def _ended_on_stop(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches``; an agreed stop leaving them ends the run on this rank (its MLflow run
        already ended or suspended by the stopper) before :class:`hpc_ddp.Stopped` goes on."""
        self._stepping = True
        try:
            yield from batches
        except Stopped:
            self._ending(None)
            raise
        except GeneratorExit:  # the loop was left at a batch (an exception ends the script)
            self._break_note.left(self.epoch, self.global_step + 1)
            raise
        finally:
            self._stepping = False

    def iterations(self, max_steps: int | None = None) -> Iterator[int]:
        """The optimizer steps of a loop that draws its own batches (nanoGPT's ``while
        True`` with ``iter_num``): yields the step's number, counted over all attempts, so a
        resumed run goes on from its checkpoint's. Do the micro-steps and the optimizer step
        inside; between iterations it does what :meth:`steps` does (stops, checkpoints,
        metrics). The random streams your batches come from are restored on resume::

            for iter_num in run.iterations(max_steps=5000):
                if run.every(eval_interval):
                    evaluate()
                for micro_step in range(accum):
                    ...
                optimizer.step()
        """
        max_steps = optional_whole_number(max_steps, "run.iterations(max_steps)")
        for _ in self.steps(Ticks(), max_steps=max_steps):
            yield self.global_step

    def every(self, steps: int) -> bool:
        """True once every ``steps`` optimizer steps (when the steps done so far divide by
        it; step 0 included), on the first micro-batch of the step whatever the
        accumulation, so ``if run.every(200): evaluate()`` runs once per 200 steps on every
        rank. The stall watchdog rests while your code runs (an evaluation longer than
        ``dist.stall_timeout_s`` is no stall)."""
        return self._loop.every(whole_number(steps, "run.every(steps)"))

    def save(self) -> None:
        """Write a checkpoint (a collective: call it on every rank, e.g. under
        :meth:`every`): inside :meth:`steps` at the end of the optimizer step in progress,
        so it resumes exactly; between epochs at once."""
        self._loop.request_save()

    # -- metrics -----------------------------------------------------------------------------

    def log(self, name: str, total: torch.Tensor | float, count: torch.Tensor | float = 1) -> None:
        """Add a training metric: ``total`` summed over ``count`` items (a loss times the
        batch size, and the batch size). Logged as total/count over all ranks per interval
        (``interval/<name>``) and per epoch (``<name>``); never synchronises the device."""
        self._loop.metrics.add(name, total, count)

    def sums(self) -> Sums:
        """Exact sums over all ranks, for evaluation: ``sums.add(name, total, count)`` per
        batch, then ``sums.reduce()`` on every rank."""
        return Sums(self.device, self._context.control_group)

    def log_metrics(self, metrics: Mapping[str, float | Sum], step: int | None = None) -> None:
        """Record values that are already the same on every rank (rank 0 writes them), at
        ``step`` (default: the global step). A :class:`hpc_ddp.Sum` is logged as its mean,
        so ``run.log_metrics(sums.reduce())`` logs an evaluation's means."""
        step = self.global_step if step is None else logged_step(step)
        values = scalar_metrics(metrics)
        self._context.tracker.log_metrics(values, step)
        if self.is_main:  # what a script logs reaches its terminal too
            get_logger().info(f"step {step}: {metric_text(values)}")

    def log_text(self, name: str, text: str) -> None:
        """Store ``text`` as an artifact of the MLflow run (rank 0)."""
        self._context.tracker.log_text_artifact(check_name(name, "run.log_text"), text)

    # -- the end -----------------------------------------------------------------------------

    def finish(self, summary: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """End the run: the final checkpoint, the replica check, summary.json (rank 0; the
        run's facts plus ``summary``), MLflow FINISHED, the process group down. Returns the
        summary on every rank."""
        if self._finished:
            raise HpcDdpError("run.finish() was called twice", "call it once, after training")
        self._finished = True
        self._break_note.say()
        return finish_run(
            self._context, self._loop.finish, self._ending, self._started, self._timeline, summary
        )

    def close(self, status: str = "FAILED") -> None:
        """End the run without a final checkpoint (after an error): MLflow ``status``,
        signal handlers restored. :meth:`finish` is the normal end."""
        self._ending(status)

    def __enter__(self) -> Run:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if error is None:
            if not self._finished:
                self.finish()
        elif not isinstance(error, SystemExit):  # on record as a failure; Ctrl-C: KILLED
            self._ending.fail(error)
