"""The open-file limit a rank needs at a world size, raised where the hard limit allows.

Every connection is a file descriptor. Rank 0 hosts the rendezvous store (one connection per
rank) and is the root of the gathers and broadcasts on both gloo groups (one connection per
peer in each), so it holds about 3 W sockets; a default soft limit of 1,024 ends a job of a
few hundred ranks with "Too many open files" in the middle of a collective.
"""

from __future__ import annotations

import resource

#: Descriptors beyond the sockets: the interpreter, logs, checkpoints, DataLoader pipes.
HEADROOM = 256


def open_files_needed(world_size: int, is_main: bool) -> int:
    """Descriptors a rank may hold at ``world_size`` ranks (an upper estimate)."""
    peers = world_size - 1
    sockets = 3 * world_size if is_main else 2 * peers + 1
    return sockets + HEADROOM


def raise_open_file_limit(needed: int) -> tuple[int, int, bool]:
    """Raise the soft RLIMIT_NOFILE to ``needed`` (at most the hard limit) if it is lower.
    Returns (soft, hard, enough) after the change."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = hard == resource.RLIM_INFINITY
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if unlimited else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    enough = soft == resource.RLIM_INFINITY or soft >= needed
    return soft, hard, enough


def open_file_warning(world_size: int, needed: int, soft: int, hard: int) -> str:
    return (
        f"the open-file limit is {soft} (hard limit {hard}), but rank 0 of {world_size} ranks "
        f"may hold about {needed} sockets and files; a collective can then fail with 'Too many "
        "open files'. HINT: raise it before the job starts (`ulimit -n "
        f"{needed}` in slurm/site.sh), or ask the cluster's admins to raise the hard limit"
    )
