"""hpc_ddp: PyTorch DistributedDataParallel training on Slurm clusters.

The same entry point (``python -m hpc_ddp.train``) runs under ``sbatch slurm/train.sh``,
``hpc-ddp local`` (N CPU ranks) and submitit::

    import hpc_ddp
    job = hpc_ddp.submit("configs/digits.yaml", nodes=2, gpus_per_node=4, time="1:00:00")
    results = hpc_ddp.wait(job)

Importing the package is cheap: torch and submitit load only when a function needs them.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["submit", "wait"]


def submit(*args: Any, **kwargs: Any) -> Any:
    """Submit training through submitit; see :func:`hpc_ddp.jobs.submit`."""
    from hpc_ddp.jobs import submit as submit_job

    return submit_job(*args, **kwargs)


def wait(job: Any, poll_s: float = 1.0) -> list[dict[str, Any]]:
    """Every rank's result of a submitted job; see :func:`hpc_ddp.jobs.wait`."""
    from hpc_ddp.jobs import wait as wait_for_job

    return wait_for_job(job, poll_s)
