"""The runtime library a training script calls; its public face is :func:`hpc_ddp.start`.

Rooms, by concern (each imports only from the shared modules here and from rooms above it
in this list):

- ``place/``: where this rank is: the launcher's environment resolved into a frozen
  ``DistEnv``, Slurm's notation, the launch plan, the device, the run directory.
- ``checkpoint/``: what a checkpoint holds of the user's objects and the files on disk.
- ``tracking/``: MLflow on rank 0, its background process, the run's own record and replay.
- ``monitor/``: where the run's time goes (each rank's wait for data, per interval).
- ``preempt/``: stop signals, the job's requeue, the stall watchdog.
- ``loop/``: the step boundary as named parts: the loop that counts, the stopper that
  decides with the other ranks, the checkpointer that owns what a checkpoint holds, interval
  metrics; the loaders and the user's own iterables.
- ``session/``: one run: ``start`` wires the parts, ``Run`` is what a script holds, how a
  run resumes, ends and sums itself up.

The modules at this level are shared leaves with no room of their own: errors and exit
codes, logs, settings.
"""
