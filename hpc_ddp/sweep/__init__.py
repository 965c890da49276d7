"""Sweeps: many runs of one program, one Slurm job array, one record, one MLflow parent run.

``hpc-ddp sweep submit SWEEP.yaml -- train.py ...`` or :func:`hpc_ddp.submit_sweep` from
Python. Its parts: spec (the sweep file and its expansion), programs (what it runs and the
settings it may set), manifest (the record), arrays (job arrays and their scripts), submit
(submission and resume), task (what each array task runs), parent (the MLflow parent run),
views (status and plot), api (the Python call).
"""
