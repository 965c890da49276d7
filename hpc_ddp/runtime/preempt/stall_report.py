"""A stalled rank's report: where its main thread is stuck (in the user's code, waiting for a
DataLoader worker, or inside torch), every thread's stack written in one turn with the other
ranks, the record of what ended it, and its exit code. :mod:`.watchdog` decides when."""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
from types import FrameType

import torch

from hpc_ddp.runtime.errors import EXIT_PEER_LOST, EXIT_STALLED
from hpc_ddp.runtime.exits import innermost_user_frame
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.turns import OutputTurns

#: Seconds a stalled rank waits for its turn to write its stacks before it writes anyway.
OUTPUT_TURN_WAIT_S = 5.0
#: How :func:`where_stuck` says that a thread waits inside torch.
INSIDE_TORCH = "inside torch, waiting for other ranks or the device"
#: ... that it waits for torch's data loading.
WAITS_FOR_DATA = "waiting for a DataLoader worker"
#: ... that it is in the user's code, neither.
IN_OWN_CODE = "in its own code"

_TORCH = os.path.dirname(torch.__file__) + os.sep
_TORCH_DATA = os.path.join(_TORCH, "utils", "data") + os.sep


def stuck_in(frame: FrameType | None) -> tuple[str, str | None]:
    """What a thread whose innermost frame is ``frame`` waits for: :data:`WAITS_FOR_DATA`,
    :data:`INSIDE_TORCH` (a collective, the device), :data:`IN_OWN_CODE` or "no Python
    frame"; and the innermost frame of the user's code
    (:func:`~hpc_ddp.runtime.exits.innermost_user_frame`) as ``file:line in function``, None
    where there is none."""
    frames: list[FrameType] = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    if not frames:
        return "no Python frame", None
    index = innermost_user_frame([f.f_code.co_filename for f in frames])
    user = frames[index] if index is not None else None
    at = f"{user.f_code.co_filename}:{user.f_lineno} in {user.f_code.co_name}" if user else None
    below_user = frames[: frames.index(user)] if user is not None else frames
    if any(f.f_code.co_filename.startswith(_TORCH_DATA) for f in below_user):
        return WAITS_FOR_DATA, at
    if any(f.f_code.co_filename.startswith(_TORCH) for f in below_user):
        return INSIDE_TORCH, at
    return IN_OWN_CODE, at


def where_stuck(frame: FrameType | None) -> str:
    """What a thread whose innermost frame is ``frame`` waits for, in words
    (:func:`stuck_in`): where in the user's code, and whether it waits in torch's data
    loading or elsewhere inside torch."""
    return stuck_words(*stuck_in(frame))


def stuck_words(kind: str, at: str | None) -> str:
    """:func:`stuck_in`'s finding in words: what the thread waits for, called from where."""
    called_from = f"{at}()" if at else "?"
    if kind == IN_OWN_CODE:
        return f"in {called_from}"
    if kind in (WAITS_FOR_DATA, INSIDE_TORCH):
        return f"{kind} (called from {called_from})"
    return kind


def write_stall_report(
    rank: int, stalled: str, stuck: str, others: str, output: OutputTurns
) -> None:
    """The report of a rank that ``stalled`` (what, and where in the run) with its main thread
    ``stuck`` (:func:`where_stuck`), and what its ``others`` say (the silent ranks): the line
    naming the rank, every thread's stack, the line ending the job, in one turn."""
    log = get_logger()
    stacks = thread_stacks()
    sys.stdout.flush()  # before the turn: a rank's labelled stdout takes turns itself
    # The ranks stall together: each one's stacks go out whole, not woven into another's.
    with output.turn(OUTPUT_TURN_WAIT_S):
        log.error(
            f"rank {rank} stalled: {stalled}; its main thread is {stuck}"
            + (f"; {others}" if others else "")
            + ". Every thread's stack follows."
        )
        for handler in log.handlers:
            handler.flush()
        if stacks is None:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        else:
            sys.stderr.write(stacks)
        sys.stderr.flush()
        log.error(
            f"rank {rank} ends the job: stalled {stuck}"
            + (f"; {others}" if others else "")
            + ". HINT: the stack above shows "
            "where; a rank inside torch waits for another one (look for the rank stalled "
            "in its own code or in a DataLoader worker); raise dist.stall_timeout_s if a "
            "step legitimately takes this long"
        )


def thread_stacks() -> str | None:
    """Every thread's Python stack as faulthandler writes it (it writes only to a file
    descriptor, in many small pieces: gathered here to go out in one turn); None when no
    temporary file can be made (a full or missing TMPDIR)."""
    try:
        with tempfile.TemporaryFile("w+") as dump:
            faulthandler.dump_traceback(file=dump, all_threads=True)
            dump.seek(0)
            return dump.read()
    except OSError:
        return None


def stall_failure(stalled: str, at: str | None, others: str, follows: bool) -> dict[str, object]:
    """What ended a rank that ``stalled`` (what it waited for) for the run's record of
    failures (the fields of :func:`hpc_ddp.runtime.exits.failure_record`): ``at`` the user's
    line it was in, ``others`` what the silent ranks' watch says, ``follows`` whether it only
    waited for another rank."""
    said = f"stalled: {stalled}" + (f"; {others}" if others else "")
    return {"error": said[:300], "at": at, "follows_another_rank": follows}


def stall_exit_code(kind: str, other_ranks: bool) -> int:
    """:data:`EXIT_PEER_LOST` for a rank of several whose main thread only waits inside torch
    (``kind``, :func:`stuck_in`), a consequence of another rank's stall; :data:`EXIT_STALLED`
    for one stuck itself, or alone."""
    return EXIT_PEER_LOST if other_ranks and kind == INSIDE_TORCH else EXIT_STALLED
