"""How a rank ends on an exception: one line for what the user can fix or what another rank
caused, the traceback for a crash, and the documented exit code (README: Failure).

Standard library only, like :mod:`hpc_ddp.runtime.errors`.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Mapping
from types import FrameType, TracebackType

from hpc_ddp.runtime.errors import (
    EXIT_FAILURE,
    EXIT_PEER_LOST,
    EXIT_USER_ERROR,
    HpcDdpError,
    lost_peer,
)

#: Exit code of a rank stopped with Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130


def rank_label(environ: Mapping[str, str]) -> str:
    """This process's rank as the launcher set it, before anything is resolved."""
    return (
        environ.get("SLURM_PROCID")
        or environ.get("RANK")
        or environ.get("SUBMITIT_LOCAL_GLOBALID")
        or "0"
    )


def user_traceback(error: BaseException, hidden: Callable[[str], bool]) -> str:
    """The traceback of ``error`` without its leading frames whose file ``hidden`` names
    (the launcher's own frames above the user's code)."""
    frames: TracebackType | None = error.__traceback__
    while frames is not None and frames.tb_next is not None and hidden(_file(frames.tb_frame)):
        frames = frames.tb_next
    return "".join(traceback.format_exception(type(error), error, frames))


def _file(frame: FrameType) -> str:
    return frame.f_code.co_filename


def report_failure(
    error: BaseException, label: str, hidden: Callable[[str], bool] | None = None
) -> int:
    """Print what ends this rank and return its exit code: 2 and one line for an
    HpcDdpError, 4 and one line when another rank went away, 130 for Ctrl-C, else 1 and the
    traceback (without the leading frames ``hidden`` names)."""
    if isinstance(error, HpcDdpError):
        print(f"[rank {label}] error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    if isinstance(error, KeyboardInterrupt):
        print(f"[rank {label}] interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    peer_gone = lost_peer(error)
    if peer_gone:
        print(
            f"[rank {label}] stopped: another rank went away during a collective "
            f"({peer_gone[:300]}); that rank's output shows the cause",
            file=sys.stderr,
        )
        return EXIT_PEER_LOST
    text = user_traceback(error, hidden or (lambda _path: False))
    print(f"[rank {label}] failed:\n{text}", file=sys.stderr, end="")
    return EXIT_FAILURE
