"""Where this rank is: the launcher's environment read once into a frozen ``DistEnv``, Slurm's
notation (node lists, tasks per node), the launch plan and its device, the run directory."""
