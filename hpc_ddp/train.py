"""The built-in trainer's entry point: ``python -m hpc_ddp.train --config configs/x.yaml``.

Stop signals are held from the first line, before the seconds of importing torch: a stop
signal that arrives then is handled once training starts instead of killing the rank. Rank
0's tracking process starts there too, so that mlflow's import overlaps torch's. The garbage
collector is held off until the trainer and torch are imported, and frozen again before the
exit (see import_gc).
"""

from __future__ import annotations

if __name__ == "__main__":
    import os
    import sys

    from hpc_ddp.cli.entry import before_imports

    before_imports(os.environ, sys.argv[1:], dry_run="--dry-run" in sys.argv)

    from hpc_ddp.cli.train import main
    from hpc_ddp.runtime.exits import exit_process
    from hpc_ddp.runtime.import_gc import freeze_for_exit, freeze_imports

    freeze_imports()
    code = main()
    freeze_for_exit()
    exit_process(code)
