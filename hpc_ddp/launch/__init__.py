"""The launchers: local ranks, Slurm templates and their rendering, submitit, doctor; and
the program every rank of a launch runs."""
