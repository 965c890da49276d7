"""How a rank ends on an exception: one line for what the user can fix or what another rank
caused, the traceback for a crash, and the documented exit code (README: Failure).

Standard library only, like :mod:`hpc_ddp.runtime.errors`.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
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
    (the toolkit's own frames above the user's code); whole when every frame is hidden (an
    error of the toolkit itself)."""
    frames: TracebackType | None = error.__traceback__
    every: list[TracebackType] = []
    while frames is not None:
        every.append(frames)
        frames = frames.tb_next
    shown = next((tb for tb in every if not hidden(_file(tb.tb_frame))), None)
    frames = shown or error.__traceback__
    return "".join(traceback.format_exception(type(error), error, frames))


def _file(frame: FrameType) -> str:
    return frame.f_code.co_filename


_PACKAGE = str(Path(__file__).resolve().parent.parent) + os.sep


def toolkit_frame(path: str) -> bool:
    """A frame of hpc_ddp itself (or of runpy, which starts it), not of the user's code."""
    return "runpy" in path or path.startswith(_PACKAGE)


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
