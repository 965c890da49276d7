"""Checkpoints as ``step-N/`` folders that every rank writes through
``torch.distributed.checkpoint`` (DCP).

Each rank hands DCP the same state dict shape; DCP writes a replicated tensor once, the
writes spread over the ranks (each writes about 1/W of the bytes), and a sharded one
(FSDP2's DTensors) by each owner. The coordinator writes ``.metadata`` last, through a
temporary name: a folder without it is a save that did not finish, never a checkpoint.

torch.distributed.checkpoint is imported at the first save or load, not with hpc_ddp (it
takes most of a second).

Small values travel as one blob each (``torch.save`` bytes, unpacked with
``weights_only=True``): the run's own state under ``run`` (rank 0's), and each rank's random
streams and batch state under ``rank.<r>``, so a rank reads only its own. torch itself reads
a folder's ``.metadata`` and the wrapper of each non-tensor item with plain pickle; hpc_ddp
reads the metadata admitting only DCP's own classes and each item with ``weights_only=True``,
so a planted pickle runs no code.

The parts: :mod:`.layout` (the folder's keys and blobs), :mod:`.writing`, :mod:`.metadata`
(reading ``.metadata`` safely, and checking the files it names) and :mod:`.reading`.
"""
