"""A sweep from Python, as ``hpc-ddp sweep submit`` makes it (``hpc_ddp.submit_sweep``, in
:mod:`hpc_ddp.cli.api`, calls it with the built-in trainer's settings)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.sweep.spec import DEFAULT_MAX_TASKS


class Sweep:
    """A submitted sweep: its folder, and its tasks as `hpc-ddp sweep status` shows them
    (``hpc_ddp.Sweep("runs/lr")`` picks up one submitted earlier)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def __repr__(self) -> str:
        return f"Sweep({str(self.directory)!r})"

    def status(self) -> list[Any]:
        """Every task (hpc_ddp.sweep.views.TaskRow), best first."""
        from hpc_ddp.sweep.views import sweep_status

        return sweep_status(self.directory, os.environ)[1]

    def results(self) -> list[Any]:
        """What rank 0 of each task returned, in task order, for a sweep of a callable
        (None for a task that returned None, failed or has not ended)."""
        from hpc_ddp.sweep import manifest
        from hpc_ddp.sweep.calls import read_result

        data = manifest.read_manifest(self.directory)
        return [
            read_result(manifest.run_dir_of(data, task)) if task["state"] == "finished" else None
            for task in data["tasks"]
        ]

    def wait(self, poll_s: float = 10.0, timeout_s: float | None = None) -> list[Any]:
        """Poll until no task is pending, running or requeued; returns the tasks."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            rows = self.status()
            if all(row.state not in ("pending", "running", "requeued") for row in rows):
                return rows
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"sweep {self.directory} still runs after {timeout_s} s")
            time.sleep(poll_s)


def as_lists(given: Mapping[str, Any] | None, where: str) -> dict[str, list[Any]] | None:
    """``grid=`` or ``zip=`` with each key's values as a list; refuses values that are not a
    list, tuple or range (a string would be one value, not split on its commas)."""
    if given is None:
        return None
    for key, values in given.items():
        if not isinstance(values, list | tuple | range):
            raise HpcDdpError(
                f"submit_sweep({where}={{{key!r}: {values!r}}}): the values are a "
                f"{type(values).__name__}, expected a list of values",
                f"{where}={{{key!r}: [...]}}, e.g. [0.1, 0.01] (a string is one value, not "
                "split on commas)",
            )
    return {key: list(values) for key, values in given.items()}


def submit_sweep(
    program: str | Sequence[str] | Callable[..., Any],
    *,
    name: str,
    kwargs: Mapping[str, Any] | None = None,
    grid: Mapping[str, Sequence[Any]] | None = None,
    zip: Mapping[str, Sequence[Any]] | None = None,
    tasks: Sequence[Mapping[str, Any]] | None = None,
    concurrency: int | None = None,
    metric: str | None = None,
    mode: Literal["min", "max"] | None = None,
    max_tasks: int = DEFAULT_MAX_TASKS,
    nodes: int = 1,
    gpus_per_node: int = 0,
    tasks_per_node: int | None = None,
    cpus_per_task: int | None = None,
    time: str = "01:00:00",
    partition: str | None = None,
    output_dir: str | Path = "runs",
    sbatch: Mapping[str, str | int | bool | None] | None = None,
    trainer_settings: Collection[str] = (),
) -> Sweep:
    """Submit ``program`` once per combination of ``grid``, row of ``zip`` and entry of
    ``tasks``, as Slurm job arrays of at most ``concurrency`` running tasks; each task is a
    whole hpc_ddp run in ``output_dir/name/task-N``.

    ``program``: a command line (``"train.py --epochs 5"`` split as a shell would, or a list
    of words; ``-m pkg.mod ...`` for a module), or a Python callable that every rank of each
    task calls with ``kwargs`` and the task's own keyword arguments, as submitit's
    ``map_array`` does (``Sweep.results()`` holds what rank 0 returned). Keys are the
    program's options (``"lr"`` or ``"--lr"``; a callable's keyword arguments) or dotted
    hpc_ddp settings (``"run.seed"``). ``sbatch``: any other sbatch option of the arrays
    (``{"account": "lab"}``), over the site profile's (slurm/site.yaml). ``trainer_settings``:
    the built-in trainer's dotted keys, for a sweep of it (``hpc_ddp.submit_sweep`` gives
    them)."""
    import shlex

    from hpc_ddp.launch.sbatch import RenderRequest
    from hpc_ddp.launch.slurmoptions import api_options
    from hpc_ddp.sweep.calls import CallableProgram, argument_text
    from hpc_ddp.sweep.programs import SweepProgram, sweep_program
    from hpc_ddp.sweep.spec import command_line_key, spec_from_dict
    from hpc_ddp.sweep.submit import submit_sweep as submit

    parsed: SweepProgram
    if callable(program):
        parsed = CallableProgram(program, dict(kwargs or {}))
    elif kwargs:
        raise HpcDdpError(
            "kwargs= applies to a callable", "pass a program's own options in its command line"
        )
    else:
        words = shlex.split(program) if isinstance(program, str) else list(program)
        parsed = sweep_program(words)

    def texts(value: Any, many: bool) -> Any:
        if many and isinstance(value, list | tuple):
            return [argument_text(one) for one in value]
        return argument_text(value)

    def keyed(values: Mapping[str, Any], many: bool) -> dict[Any, Any]:
        """Plain keys as the program's options; a callable's values as text that reads back
        as the same value."""
        if isinstance(parsed, CallableProgram):
            values = {key: texts(value, many) for key, value in values.items()}
        return {command_line_key(k) if isinstance(k, str) else k: v for k, v in values.items()}

    grid, zip = as_lists(grid, "grid"), as_lists(zip, "zip")
    raw: dict[str, Any] = {"name": name, "concurrency": concurrency, "metric": metric}
    raw.update(mode=mode, max_tasks=max_tasks)
    raw.update(grid=grid and keyed(grid, True), zip=zip and keyed(zip, True))
    if tasks is not None:
        raw["list"] = [keyed(task, False) for task in tasks]
    spec = spec_from_dict({key: value for key, value in raw.items() if value is not None}, name)
    request = RenderRequest(
        arguments=(),
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        cpu_tasks_per_node=tasks_per_node or 1,
        cpus_per_task=cpus_per_task,
        time=time,
        partition=partition,
        sbatch_options=tuple(api_options(sbatch, Path.cwd(), os.environ).items()),
    )
    return Sweep(
        submit(
            spec, parsed, request, Path(output_dir), os.environ, print,
            trainer_settings=trainer_settings,
        )
    )  # fmt: skip
