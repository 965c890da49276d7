"""``hpc_ddp.submit`` and ``hpc_ddp.submit_sweep``: the launchers' own functions, told what
the built-in trainer is. The launchers run programs and callables and know no trainer; here
a ``.yaml`` target (or the trainer's ``Config``) becomes a job that trains with it, and a
sweep of the trainer learns which dotted settings it takes."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_ddp.launch import jobs
from hpc_ddp.runtime import configfile
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.sweep import api as sweeps

if TYPE_CHECKING:
    from hpc_ddp.trainer.config import Config


def trainer_settings() -> set[str]:
    """The built-in trainer's dotted settings (``train.epochs``, ``run.seed``, ...)."""
    from hpc_ddp.trainer.config import Config

    return set(configfile.flatten(Config()))


def train_with(config: Config) -> dict[str, Any]:
    """What every task of a job of the built-in trainer runs: its summary on this rank."""
    from hpc_ddp.trainer.loop import train

    return train(config)


def submit(
    target: Callable[..., Any] | str | Path | Sequence[str] | Config,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    overrides: Sequence[str] = (),
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
    """Submit a job whose every task runs ``target``; returns the submitit Job
    (``hpc_ddp.wait(job)``: every rank's result).

    ``target``: a callable (run as ``target(*args, **kwargs)`` on every rank; it calls
    :func:`hpc_ddp.start` itself), a script path or a command line (``["train.py", "--lr",
    "3e-4"]``, ``["-m", "pkg.train"]``; more arguments in ``args``), or a YAML config of
    the built-in trainer (with dotted ``overrides``; every rank's result is its summary).
    One task per GPU: ``tasks_per_node`` defaults to ``gpus_per_node`` (1 without GPUs).
    ``cluster``: None detects Slurm, "local" runs on this machine, "slurm" insists on Slurm.
    ``sbatch``: any other sbatch option (``{"account": "lab", "exclusive": True}``), over the
    site profile's (slurm/site.yaml, ~/.config/hpc_ddp/site.yaml); ``slurm_parameters``:
    submitit's own ``slurm_*`` parameters. Everything is checked here, before anything is
    queued.
    """
    from hpc_ddp.trainer.config import Config, load_config

    options: dict[str, Any] = dict(
        nodes=nodes, gpus_per_node=gpus_per_node, tasks_per_node=tasks_per_node, time=time,
        partition=partition, cpus_per_task=cpus_per_task, cluster=cluster, folder=folder,
        name=name, slurm_parameters=slurm_parameters, sbatch=sbatch,
    )  # fmt: skip
    if isinstance(target, str | Path) and str(target).endswith((".yaml", ".yml")):
        target = load_config(target, overrides)  # checked here, before anything is queued
    elif overrides:
        raise HpcDdpError(
            "overrides= applies to a config of the built-in trainer",
            "pass your program's own arguments with args=",
        )
    if isinstance(target, Config):
        return jobs.submit(train_with, args=(target,), **options)
    return jobs.submit(target, args=args, kwargs=kwargs, **options)


def submit_sweep(program: str | Sequence[str] | Callable[..., Any], **options: Any) -> Any:
    return sweeps.submit_sweep(program, trainer_settings=trainer_settings(), **options)


# help(hpc_ddp.submit_sweep) shows the launcher's documentation and options, less the one
# given here.
submit_sweep.__doc__ = (sweeps.submit_sweep.__doc__ or "").partition(" ``trainer_settings``:")[0]
_SWEEP_OPTIONS = inspect.signature(sweeps.submit_sweep)
submit_sweep.__signature__ = _SWEEP_OPTIONS.replace(  # type: ignore[attr-defined]
    parameters=[p for n, p in _SWEEP_OPTIONS.parameters.items() if n != "trainer_settings"]
)
