"""The built-in trainer's entry point: ``python -m hpc_ddp.train --config configs/x.yaml``.

Stop signals are held from the first line, before the seconds of importing torch: a stop
signal that arrives then is handled once training starts instead of killing the rank.
"""

from __future__ import annotations

if __name__ == "__main__":
    from hpc_ddp.runtime.startup_signals import hold_stop_signals

    hold_stop_signals()

    import sys

    from hpc_ddp.trainer.main import main

    sys.exit(main())
