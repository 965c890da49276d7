"""`python -m hpc_ddp.launch.templates`: the path of the installed job-body.sh, which the job
templates source (a job script runs from Slurm's spool, away from any checkout)."""

from pathlib import Path

print(Path(__file__).resolve().parent / "job-body.sh")
