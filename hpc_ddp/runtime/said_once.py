"""An error every rank meets alike (a setting they all read) said once on each host, not once
a rank: the ranks a launcher started on a host are the children of one process (slurmstepd,
torchrun's agent, `hpc-ddp local`), so the first of them to claim a file named after that
parent and the launch says it, and the others end quietly once it has been said. A process
no launcher numbered (plain ``python``, whose parent may be a shell that runs it again and
again) always says it.

Standard library only, like :mod:`hpc_ddp.runtime.exits`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

#: How long a rank that did not claim the error waits for the one that did to say it,
#: before it says it itself (the other was killed before it could: nothing is lost).
SAID_WAIT_S = 20.0
#: Between looks for the said mark.
LOOK_EVERY_S = 0.05


#: What tells one launch by the same parent from another: torchrun's restart of its workers
#: (said again), the port of the rendezvous, the Slurm step.
LAUNCH_VARIABLES = ("TORCHELASTIC_RESTART_COUNT", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_STEP_ID")


def siblings_mark(folder: Path, parent_pid: int, environ: Mapping[str, str]) -> Path | None:
    """The mark's path for the ranks of this launch that ``parent_pid`` started (its pid
    and start time: a pid used again later is another process), or None for a process no
    launcher numbered (no LOCAL_RANK or SLURM_LOCALID) or where /proc cannot say."""
    if "LOCAL_RANK" not in environ and "SLURM_LOCALID" not in environ:
        return None
    try:
        stat = Path(f"/proc/{parent_pid}/stat").read_text()
        started = stat[stat.rindex(")") + 2 :].split()[19]
    except (OSError, ValueError, IndexError):
        return None
    launch = "\0".join(environ.get(name, "") for name in LAUNCH_VARIABLES)
    digest = hashlib.sha256(launch.encode()).hexdigest()[:12]
    return folder / f"hpc_ddp-said-{os.getuid()}-{parent_pid}-{started}-{digest}"


def say_once(
    say: Callable[[], None],
    mark: Path | None,
    clock: Callable[[], float] = time.monotonic,
    wait: Callable[[float], None] = time.sleep,
) -> bool:
    """Call ``say`` unless another process claimed ``mark`` (created it first) and said it
    (wrote into it) within SAID_WAIT_S; returns whether this process said it. Without a
    mark, or one that cannot be created, it says it."""
    if mark is None:
        say()
        return True
    try:
        claimed = os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        deadline = clock() + SAID_WAIT_S
        while clock() < deadline:
            if said_in(mark):
                return False
            wait(LOOK_EVERY_S)
        say()
        return True
    except OSError:  # a folder it cannot write in: every rank says it
        say()
        return True
    try:
        say()
        os.write(claimed, b"said\n")
    finally:
        os.close(claimed)
    return True


def said_in(mark: Path) -> bool:
    try:
        return mark.stat().st_size > 0
    except OSError:
        return False


def say_once_on_this_host(say: Callable[[], None]) -> bool:
    """:func:`say_once` among this process's siblings, marked in the temporary folder."""
    mark = siblings_mark(Path(tempfile.gettempdir()), os.getppid(), os.environ)
    return say_once(say, mark)
