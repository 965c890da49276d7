"""The runtime library a training script calls: environment, process group, devices,
loaders, checkpoints, preemption, metrics and tracking. Its public face is `hpc_ddp.start`."""
