"""hpc_ddp: PyTorch DistributedDataParallel training on Slurm clusters.

Your own training script, with a few lines added::

    import hpc_ddp

    run = hpc_ddp.start()
    model = run.wrap(model)
    loader = run.train_loader(dataset, batch_size=256)      # the global batch
    run.register(model=model, optimizer=optimizer)
    for epoch in run.epochs(10):
        for batch in run.steps(loader):
            ...
    run.finish()

runs under ``sbatch slurm/train.sh train.py``, ``hpc-ddp local --nproc 4 train.py``,
torchrun and submitit (``hpc_ddp.submit(main, nodes=2, gpus_per_node=4)``), with agreed
preemption stops, requeue, exact resume and exact metrics. The built-in trainer
(``python -m hpc_ddp.train --config configs/digits.yaml``) is one such script.

Importing the package is cheap: torch, mlflow and submitit load only when a name needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hpc_ddp.runtime.errors import HpcDdpError, Stopped

if TYPE_CHECKING:
    from hpc_ddp.cli.api import submit, submit_sweep
    from hpc_ddp.launch.jobs import wait
    from hpc_ddp.launch.spawn import spawn
    from hpc_ddp.runtime.checkpoint.loading import Resumed
    from hpc_ddp.runtime.config import RuntimeConfig
    from hpc_ddp.runtime.loop.data import StepLoader
    from hpc_ddp.runtime.loop.metrics import Sum, Sums
    from hpc_ddp.runtime.place.distenv import DistEnv
    from hpc_ddp.runtime.session.run import Run
    from hpc_ddp.runtime.session.start import start
    from hpc_ddp.sweep.api import Sweep

__version__ = "0.1.0"
__all__ = [
    "DistEnv",
    "HpcDdpError",
    "Resumed",
    "Run",
    "RuntimeConfig",
    "StepLoader",
    "Stopped",
    "Sum",
    "Sums",
    "Sweep",
    "spawn",
    "start",
    "submit",
    "submit_sweep",
    "wait",
]

_LAZY = {
    "start": "hpc_ddp.runtime.session.start",
    "Run": "hpc_ddp.runtime.session.run",
    "Resumed": "hpc_ddp.runtime.checkpoint.loading",
    "StepLoader": "hpc_ddp.runtime.loop.data",
    "Sum": "hpc_ddp.runtime.loop.metrics",
    "Sums": "hpc_ddp.runtime.loop.metrics",
    "RuntimeConfig": "hpc_ddp.runtime.config",
    "DistEnv": "hpc_ddp.runtime.place.distenv",
    "spawn": "hpc_ddp.launch.spawn",
    "submit": "hpc_ddp.cli.api",
    "wait": "hpc_ddp.launch.jobs",
    "submit_sweep": "hpc_ddp.cli.api",
    "Sweep": "hpc_ddp.sweep.api",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hpc_ddp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
