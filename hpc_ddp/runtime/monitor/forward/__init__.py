"""Each rank's time in its model's training forward, and the FLOPs of one.

Under DDP every rank's step lasts as long as the slowest one's (the others wait in the
gradients' all-reduce), so the time between steps cannot name a slow rank. The forward holds
no collective of DDP's (its buffers are broadcast before the wrapped module is called), so
its length is the rank's own compute: a slow GPU, a throttled node or a larger batch shows
there. It is timed with CUDA events on a GPU (read once done: nothing waits for the GPU)
and with the clock on a CPU; a forward without gradients (an evaluation's) is not timed.

The module's ``forward`` is replaced, while the run lasts, by a :class:`TimedForward` that
calls the original: a module with forward hooks takes torch's slow path through
``Module.__call__`` (about ten Python calls more a forward, as much as a small model's step
on a CPU), one with its own ``forward`` attribute keeps the fast one.

Under FSDP (``dist.strategy=fsdp``) a forward holds the all-gathers of the sharded blocks'
parameters, which wait for every rank, so the model's forward would not name a slow rank
either. There each innermost sharded block is timed instead: FSDP gathers its parameters in
its forward pre-hook and frees them in its forward hook, both outside the block's
``forward``, so what is timed is the block's own compute. What the model does outside those
blocks (an embedding, a head) is not timed there. A forward run again inside the backward
(activation checkpointing's recomputation) is not timed: it is in the backward's time.

The FLOPs are counted once, on the first training forward (see
:mod:`hpc_ddp.runtime.monitor.flops`); a sharded block's are not.

The parts: :mod:`.timed` (the forward a timed module holds, and its copies') and
:mod:`.meter` (what a rank attaches and takes).
"""
