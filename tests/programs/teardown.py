"""A user's script that marks the interpreter's teardown and its own exit handler.

python teardown.py raise    fails after hpc_ddp.start (the process group is up)
python teardown.py finish   ends with run.finish()
"""

from __future__ import annotations

import atexit
import os
import sys
import types

import hpc_ddp


class Teardown:
    def __del__(self) -> None:
        os.write(2, b"module teardown ran\n")


# Kept in a module that only the interpreter's teardown clears.
marker = types.ModuleType("teardown_marker")
marker.kept = Teardown()  # type: ignore[attr-defined]
sys.modules["teardown_marker"] = marker
atexit.register(lambda: os.write(2, b"exit handler ran\n"))

run = hpc_ddp.start(overrides=sys.argv[2:])
if sys.argv[1] == "raise":
    raise ValueError("the user's own check failed")
run.finish()
