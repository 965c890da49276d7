"""Each rank prints long lines at the same moment as the others, as a script may print a
large dict or a table row: ``python long_lines.py FOLDER LINES LENGTH``. The ranks meet at a
file barrier in FOLDER first, so their lines overlap; each line is ``R<rank>-<i>:`` then
LENGTH copies of the rank's digit, then ``:END<rank>-<i>``."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

folder, lines, length = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
(folder / f"ready-{rank}").touch()
deadline = time.monotonic() + 120
while len(list(folder.glob("ready-*"))) < world:
    if time.monotonic() > deadline:
        sys.exit(f"rank {rank}: the other ranks never reached the barrier in {folder}")
    time.sleep(0.01)
for index in range(lines):
    print(f"R{rank}-{index}:" + str(rank % 10) * length + f":END{rank}-{index}")
