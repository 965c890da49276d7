"""hpc_ddp: PyTorch DistributedDataParallel training on Slurm clusters.

The same entry point (``python -m hpc_ddp.train``) runs under ``sbatch slurm/train.sh``,
``hpc-ddp local`` (N CPU ranks) and submitit.
"""

__version__ = "0.1.0"
