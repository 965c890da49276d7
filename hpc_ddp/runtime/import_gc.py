"""Python's cyclic garbage collector held off while a process imports its libraries.

Importing torch or mlflow creates a few hundred thousand objects that live as long as the
process. The collector walks them again and again while they are created (about 10% of the
import's CPU), and every full collection after that walks them once more (about 60 ms each
for torch, several times in a run). Held off during the imports and then frozen
(:func:`gc.freeze`: kept out of every later collection), the imports cost less and the
collections during training walk only what training creates. The price is the cyclic
garbage the imports leave (about 7,000 objects, 1 MB, for torch), which is never freed.

At the built-in trainer's exit the same freeze spares the interpreter's teardown its full
collections, which walk every object left (about 0.6 s per rank after a run): what the
trainer opened is closed by then, and Python never promised finalizers at exit.

Only for entry points that know what they import (the built-in trainer, rank 0's tracking
process); a user's own script under ``hpc-ddp run`` keeps the collector as Python sets it.
Standard library only.
"""

from __future__ import annotations

import gc

_held: list[bool] = []


def hold_collection() -> None:
    """Stop cyclic collection until :func:`freeze_imports` (if it is on now)."""
    if gc.isenabled():
        gc.disable()
        _held.append(True)


def freeze_imports() -> None:
    """Freeze every object that exists now and turn collection on again, if
    :func:`hold_collection` stopped it; nothing otherwise (a collector the caller turned off
    stays off)."""
    if _held:
        _held.clear()
        gc.freeze()
        gc.enable()


def freeze_for_exit() -> None:
    """Freeze every object that exists now, so that the interpreter's teardown does not walk
    them all again (call only where nothing left needs a finalizer to run)."""
    gc.freeze()
