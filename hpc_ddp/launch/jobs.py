"""Submit through submitit: ``hpc_ddp.submit(main, nodes=2, gpus_per_node=4)``.

Every task (one per GPU) runs the same program, a Python callable, a script or a module,
and resolves its environment exactly as under ``sbatch
slurm/train.sh``. The tasks are Checkpointable in submitit's sense: preemption (USR2, as
submitit signals it) stops all ranks after the same step with a checkpoint and requeues
the job; the requeued job runs the same task again, which resumes from that checkpoint (the
job id, hence the run directory, stays the same). ``cluster="local"`` uses submitit's local
executor: no Slurm needed.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.launch.importable import check_importable
from hpc_ddp.launch.program import Program, program_from, run_program
from hpc_ddp.launch.slurmoptions import api_options
from hpc_ddp.runtime.errors import CONSEQUENTIAL_FAILURE_MARKERS, HpcDdpError, Stopped
from hpc_ddp.runtime.place.slurm import time_to_minutes


class CallTask:
    """What every submitit task runs: ``function(*args, **kwargs)`` on this task's rank,
    returning its result (``job.results()`` holds every rank's)."""

    def __init__(
        self, function: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> None:
        self.function = function
        self.args = tuple(args)
        self.kwargs = dict(kwargs)

    def checkpoint(self, *_args: Any, **_kwargs: Any) -> Any:
        """submitit's hook: run the same task again; it resumes from its checkpoints."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(CallTask(self.function, self.args, self.kwargs))

    def __call__(self) -> Any:
        name = getattr(self.function, "__name__", type(self.function).__name__)
        sys.argv = [name]  # the run's default name, as a script's file name is
        rank = os.environ.get("SLURM_PROCID") or os.environ.get("SUBMITIT_LOCAL_GLOBALID", "0")
        try:
            return self.function(*self.args, **self.kwargs)
        except Stopped as stopped:
            if stopped.requeued:
                # As submitit does after a requeue: exit without a result; the requeued
                # attempt delivers it.
                sys.exit(-1)
            if not stopped.checkpointed:
                raise RuntimeError(
                    f"rank {rank} stopped at step {stopped.step} without a checkpoint "
                    "(checkpoint.enabled=false); a job submitted again starts from step 0"
                ) from None
            raise RuntimeError(
                f"rank {rank} stopped at step {stopped.step} after a checkpoint and the job was "
                f"not requeued; submit again with run.id={stopped.run_id} to continue"
            ) from None
        except Exception as error:
            started = sys.modules.get("hpc_ddp.runtime.session.ending")
            if started is not None:
                started.end_active_run(error)
            raise RuntimeError(f"rank {rank} on {socket.gethostname()} failed: {error}") from error


def run_program_or_raise(program: Program) -> None:
    """A script or module on this task's rank; its failure becomes an exception."""
    code = run_program(program)
    if code:
        raise RuntimeError(f"{program} exited with code {code}; its output is above")


def _task(target: object, args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> CallTask:
    """The task for a callable, a script or a command."""
    if isinstance(target, str | Path) and str(target).endswith((".yaml", ".yml")):
        raise HpcDdpError(
            f"{target} is a config of the built-in trainer, not a program",
            "submit it with hpc_ddp.submit (or hpc-ddp submit), which runs the built-in "
            "trainer with it",
        )
    if callable(target):
        return CallTask(target, args, kwargs or {})
    if kwargs:
        raise HpcDdpError("kwargs= applies to a callable", "pass a script's arguments in args=")
    if isinstance(target, str | Path):
        command = [str(target)]
    elif isinstance(target, Sequence):
        command = [str(part) for part in target]
    else:
        raise HpcDdpError(
            f"cannot submit {type(target).__name__}",
            "submit a callable, a script path or a command line (a list of strings)",
        )
    command += [str(argument) for argument in args]
    module = command[:1] == ["-m"]
    program = program_from(command[1:] if module else command, module=module)
    program.check()
    return CallTask(run_program_or_raise, (program,), {})


def _check_picklable(task: CallTask) -> None:
    import cloudpickle

    try:
        cloudpickle.dumps(task)
    except Exception as error:
        raise HpcDdpError(
            f"cannot send {getattr(task.function, '__qualname__', task.function)!r} and its "
            f"arguments to the job: they cannot be pickled ({type(error).__name__}: {error})",
            "submit a function defined at module level whose arguments are plain data "
            "(no open files, locks, sockets or process groups)",
        ) from None


def submit(
    target: Callable[..., Any] | str | Path | Sequence[str],
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    nodes: int = 1,
    gpus_per_node: int = 0,
    tasks_per_node: int | None = None,
    time: str = "01:00:00",
    partition: str | None = None,
    cpus_per_task: int | None = None,
    cluster: str | None = None,
    folder: str | Path = "logs/submitit",
    name: str = "hpc-ddp",
    slurm_parameters: Mapping[str, Any] | None = None,
    sbatch: Mapping[str, str | int | bool | None] | None = None,
) -> Any:
    """Submit a job whose every task runs ``target``, a callable, a script or a command line;
    returns the submitit Job. :func:`hpc_ddp.submit` (which also takes a config of the
    built-in trainer) documents the options."""
    import submitit

    task = _task(target, args, kwargs)
    _check_picklable(task)
    if callable(target):
        check_importable(target, "every task of the job", Path.cwd(), os.environ)
    tasks = tasks_per_node or gpus_per_node or 1
    if tasks_per_node and gpus_per_node and tasks_per_node != gpus_per_node:
        raise HpcDdpError(
            f"tasks_per_node={tasks_per_node} with gpus_per_node={gpus_per_node}",
            "DDP runs one task per GPU: leave tasks_per_node unset",
        )
    executor = submitit.AutoExecutor(folder=str(folder), cluster=cluster)
    parameters: dict[str, Any] = {
        "nodes": nodes,
        "tasks_per_node": tasks,
        "timeout_min": time_to_minutes(time),
        "name": name,
    }
    if gpus_per_node:
        parameters["gpus_per_node"] = gpus_per_node
    if cpus_per_task:
        parameters["cpus_per_task"] = cpus_per_task
    if executor.cluster == "slurm":
        if partition:
            parameters["slurm_partition"] = partition
        parameters.update({f"slurm_{k}": v for k, v in (slurm_parameters or {}).items()})
        options = api_options(sbatch, Path.cwd(), os.environ)
        if options:  # submitit writes True as a flag
            given = dict(parameters.get("slurm_additional_parameters") or {})
            given.update(
                {name: True if value is None else value for name, value in options.items()}
            )
            parameters["slurm_additional_parameters"] = given
    elif nodes > 1:
        raise HpcDdpError(
            f"nodes={nodes} needs Slurm, but submitit chose the {executor.cluster!r} executor",
            "use nodes=1 locally, or submit from a machine with Slurm (sbatch on PATH)",
        )
    elif gpus_per_node and gpus_per_node > (here := _gpus_here()):
        raise HpcDdpError(
            f"gpus_per_node={gpus_per_node} on submitit's {executor.cluster!r} executor, "
            f"which runs on this machine: it has {here} GPU(s)",
            "leave gpus_per_node out for CPU ranks here, or submit from a machine with Slurm",
        )
    executor.update_parameters(**parameters)
    return executor.submit(task)


def _gpus_here() -> int:
    import torch

    return torch.cuda.device_count()


def _task_failures(job: Any) -> list[tuple[int, str]]:
    """(rank, traceback text) of every failed task, root causes first."""
    from submitit.core.utils import UncompletedJobError

    failures = []
    for rank in range(job.num_tasks):
        try:
            job.task(rank).result()
        except UncompletedJobError as error:
            failures.append((rank, str(error)))
    return sorted(
        failures,
        key=lambda item: any(marker in item[1] for marker in CONSEQUENTIAL_FAILURE_MARKERS),
    )


def wait(job: Any, poll_s: float = 1.0) -> list[Any]:
    """Every rank's result; a failed or cancelled job becomes an HpcDdpError naming it."""
    from submitit.core.utils import FailedJobError, UncompletedJobError

    while not job.done():
        time.sleep(poll_s)
    try:
        return list(job.results())
    except FailedJobError:
        failures = _task_failures(job)
        root_rank, root_trace = failures[0] if failures else (-1, "no traceback recorded")
        others = ", ".join(str(rank) for rank, _ in failures[1:]) or "none"
        raise HpcDdpError(
            f"job {job.job_id} failed on rank {root_rank} (other failed ranks: {others}):\n"
            f"{root_trace}",
            f"the traceback above is rank {root_rank}'s; all logs are in {job.paths.folder}",
        ) from None
    except UncompletedJobError as error:
        raise HpcDdpError(
            f"job {job.job_id} ended {job.state} without results",
            "it was cancelled, timed out or lost its node; see the logs in the submitit folder",
        ) from error
