"""Stops from outside the run: the stop signals (Slurm's warning, SIGTERM, Ctrl-C) held
from a rank's first line, the job's requeue, and the stall watchdog that ends a rank making
no progress."""
