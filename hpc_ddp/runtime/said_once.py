"""An error every rank meets alike (a setting they all read) said once on each host, not once
a rank: its first rank there (local rank 0) says it and leaves a mark; the host's other ranks
end quietly once the mark is there, and say it themselves if it does not come (their first
rank was killed first: nothing is lost). A process no launcher numbered says it.

The mark is named after the ranks' parent process (slurmstepd, torchrun's agent, `hpc-ddp
local`: its pid and start time), the launch and the message, so that a mark left by an
earlier launch from the same parent silences no rank of a later one.

Standard library only, like :mod:`hpc_ddp.runtime.exits`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

#: How long a rank that is not its host's first waits for the first to say the error,
#: before it says it itself.
SAID_WAIT_S = 20.0
#: Between looks for the mark.
LOOK_EVERY_S = 0.05
#: What tells one launch by the same parent from another: torchrun's restart of its workers
#: (said again), the port of the rendezvous, the Slurm step.
LAUNCH_VARIABLES = ("TORCHELASTIC_RESTART_COUNT", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_STEP_ID")


def local_rank(environ: Mapping[str, str]) -> str | None:
    """This process's rank on its host as its launcher numbered it (None: no launcher did)."""
    return environ.get("LOCAL_RANK") or environ.get("SLURM_LOCALID")


def siblings_mark(
    folder: Path, parent_pid: int, environ: Mapping[str, str], message: str
) -> Path | None:
    """The mark's path for ``message`` among the ranks of this launch that ``parent_pid``
    started, or None for a process no launcher numbered or where /proc cannot say."""
    if local_rank(environ) is None:
        return None
    try:
        stat = Path(f"/proc/{parent_pid}/stat").read_text()
        started = stat[stat.rindex(")") + 2 :].split()[19]
    except (OSError, ValueError, IndexError):
        return None
    launch = [environ.get(name, "") for name in LAUNCH_VARIABLES]
    digest = hashlib.sha256("\0".join([*launch, message]).encode()).hexdigest()[:16]
    host = socket.gethostname().replace("/", "_")  # a temporary folder shared by hosts
    return folder / f"hpc_ddp-said-{os.getuid()}-{host}-{parent_pid}-{started}-{digest}"


def say_once(
    say: Callable[[], None],
    mark: Path | None,
    first: bool,
    clock: Callable[[], float] = time.monotonic,
    wait: Callable[[float], None] = time.sleep,
) -> bool:
    """Call ``say`` where this is the ``first`` rank of its host (then leave ``mark``) or
    there is no mark; else only if the mark did not come within SAID_WAIT_S. Returns
    whether this process said it."""
    if first or mark is None:
        say()
        if mark is not None:
            # A folder it cannot write in: the others say it after their wait.
            with contextlib.suppress(OSError):
                mark.write_text("said\n")
        return True
    deadline = clock() + SAID_WAIT_S
    while clock() < deadline:
        if mark.exists():
            return False
        wait(LOOK_EVERY_S)
    say()
    return True


def say_once_on_this_host(say: Callable[[], None], message: str) -> bool:
    """:func:`say_once` among this process's siblings, marked in the temporary folder."""
    folder, environ = Path(tempfile.gettempdir()), os.environ
    mark = siblings_mark(folder, os.getppid(), environ, message)
    return say_once(say, mark, local_rank(environ) in (None, "0"))
