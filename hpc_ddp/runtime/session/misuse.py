"""What the run's calls refuse, or say once, when a script uses them out of order: a loop
over run.steps() inside another, objects registered after the resume, a call after
run.finish(), a loop over run.steps() left by a break."""

from __future__ import annotations

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.logs import get_logger


def nested_steps() -> HpcDdpError:
    return HpcDdpError(
        "run.steps() inside a loop over run.steps() or run.iterations(): each optimizer step "
        "would be counted, checkpointed and stopped on twice",
        "loop over run.steps(loader) once per epoch; for micro-batches pass grad_accum_steps= "
        "(or run.train_loader's) and call optimizer.step() when not run.accumulating",
    )


def registered_late(call: str) -> HpcDdpError:
    return HpcDdpError(
        f"{call} after the run resumed or started training",
        "register every object before run.resume() and run.epochs()",
    )


def left_by_break(epoch: int, step: int) -> str:
    """What :class:`BreakNote` says."""
    return (
        f"the loop over run.steps() (or run.iterations()) was left by a break (or an "
        f"exception the script caught) in epoch {epoch}, during step {step}: "
        "a step counts when the loop asks for the next batch, so that step is not counted "
        f"(global_step stays {step - 1}: checkpoints, metrics and a resume take it as not "
        "taken) and the epoch's totals are not logged. HINT: end early with max_steps= "
        "(run.steps(loader, max_steps=N), run.epochs(..., max_steps=N) or "
        "run.iterations(max_steps=N)), which counts every step"
    )


class BreakNote:
    """Says once, on rank 0, at the next run.steps() or run.finish(), that a loop over
    run.steps() was left by a break (or an exception the script caught and went on from)."""

    def __init__(self, main: bool) -> None:
        self.main = main
        self._waiting: str | None = None
        self._said = False

    def left(self, epoch: int, step: int) -> None:
        """The loop was left during ``step`` of ``epoch``."""
        if not self._said and self._waiting is None:
            self._waiting = left_by_break(epoch, step)

    def say(self) -> None:
        if self._waiting is not None and self.main:
            get_logger().warning(self._waiting)
        self._said = self._said or self._waiting is not None
        self._waiting = None


def after_finish(what: str) -> HpcDdpError:
    return HpcDdpError(
        f"{what} after run.finish(): the run has ended (its final checkpoint and summary are "
        "written, the process group is down)",
        "train before run.finish(); another run starts with its own hpc_ddp.start()",
    )
