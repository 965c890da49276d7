"""An error every rank meets alike (a setting they all read) said once on each host, not once
a rank: its first rank there (local rank 0) says it and leaves a mark; the host's other ranks
end quietly once the mark is there, and say it themselves, saying why, if it does not come
(their first rank was killed first, or is far behind: nothing is lost). A process no
launcher numbered says it.

The mark is named after the host, the launch (the job and step, torchrun's run and restart,
`hpc-ddp local`'s run) and the message. A mark an earlier launch left silences nobody: the
first rank says its error whatever it finds.

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
#: What tells one launch from another on a host.
LAUNCH_VARIABLES = (
    "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT", "HPC_DDP_LOCAL_RUN_ID", "MASTER_PORT",
)  # fmt: skip


def local_rank(environ: Mapping[str, str]) -> str | None:
    """This process's rank on its host as its launcher numbered it (None: no launcher did)."""
    return environ.get("LOCAL_RANK") or environ.get("SLURM_LOCALID")


def mark_path(folder: Path, host: str, environ: Mapping[str, str], message: str) -> Path:
    """The mark of ``message`` for this launch's ranks on ``host`` (a temporary folder may be
    shared by hosts)."""
    launch = [environ.get(name, "") for name in LAUNCH_VARIABLES]
    digest = hashlib.sha256("\0".join([host, *launch, message]).encode()).hexdigest()[:24]
    return folder / f"hpc_ddp-said-{os.getuid()}-{digest}"


def leave_mark(mark: Path) -> None:
    """Create ``mark`` (never through a link someone left in its place); one that is there
    already is as good."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    with contextlib.suppress(OSError):  # a folder it cannot write in: the others say it later
        os.close(os.open(mark, flags, 0o600))


def say_once(
    say: Callable[[], None],
    say_late: Callable[[], None],
    mark: Path | None,
    first: bool,
    clock: Callable[[], float] = time.monotonic,
    wait: Callable[[float], None] = time.sleep,
) -> bool:
    """``say`` where this is the ``first`` rank of its host (then leave ``mark``) or there is
    no mark; else nothing once the mark is there, or ``say_late`` if it did not come within
    SAID_WAIT_S. Returns whether this process said it."""
    if first or mark is None:
        say()
        if mark is not None:
            leave_mark(mark)
        return True
    deadline = clock() + SAID_WAIT_S
    while clock() < deadline:
        if os.path.lexists(mark):
            return False
        wait(LOOK_EVERY_S)
    say_late()
    return True


def say_once_on_this_host(
    say: Callable[[], None], say_late: Callable[[], None], message: str
) -> bool:
    """:func:`say_once` among this launch's ranks on this host, marked in the temporary
    folder (none where there is no temporary folder to use)."""
    environ = os.environ
    rank = local_rank(environ)
    mark = None
    if rank is not None:
        with contextlib.suppress(OSError):
            mark = mark_path(Path(tempfile.gettempdir()), socket.gethostname(), environ, message)
    return say_once(say, say_late, mark, rank in (None, "0"))
