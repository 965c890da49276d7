"""What the built-in trainer's entry points (``python -m hpc_ddp.train``, ``hpc-ddp train``)
do before they import the trainer and torch.

Standard library only: it runs at the rank's first line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hpc_ddp.runtime.import_gc import hold_collection
from hpc_ddp.runtime.preempt.startup_signals import hold_stop_signals
from hpc_ddp.runtime.tracking.worker import prestart


def before_imports(environ: Mapping[str, str], settings: Sequence[str], dry_run: bool) -> None:
    """Hold the garbage collector (until import_gc.freeze_imports) and the stop signals,
    and start rank 0's tracking process unless this is a dry run."""
    hold_collection()
    hold_stop_signals()
    if not dry_run:
        prestart(environ, settings)
