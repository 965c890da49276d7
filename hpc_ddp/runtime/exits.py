"""How a rank ends on an exception: one line for what the user can fix or what another rank
caused, the traceback for a crash, and the documented exit code (README: the exit codes).

Standard library only, like :mod:`hpc_ddp.runtime.errors`.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import sys
import sysconfig
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import NoReturn

from hpc_ddp.runtime.errors import (
    EXIT_DEVICE_ERROR,
    EXIT_FAILURE,
    EXIT_PEER_LOST,
    EXIT_USER_ERROR,
    HpcDdpError,
    device_failure,
    lost_peer,
    message_of,
    no_deterministic_kernel,
)
from hpc_ddp.runtime.said_once import SAID_WAIT_S, say_once_on_this_host

#: Exit code of a rank stopped with Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130


def rank_label(environ: Mapping[str, str]) -> str:
    """This process's rank as the launcher set it, before anything is resolved (torchrun's
    RANK first: under torchrun in a Slurm job, SLURM_PROCID numbers the agents, not the
    ranks)."""
    return (
        environ.get("RANK")
        or environ.get("SLURM_PROCID")
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


#: Where the interpreter's own modules and installed packages live.
_INSTALLED = tuple(
    {
        os.path.join(path, "")
        for key, path in sysconfig.get_paths().items()
        if key in ("stdlib", "platstdlib", "purelib", "platlib")
    }
)
_PACKAGE_FOLDERS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


def innermost_user_frame(files: Sequence[str]) -> int | None:
    """Which of a stack's frames, given by their files innermost first, is the innermost of
    the user's code: outside hpc_ddp, torch, the standard library and installed packages;
    else (a script installed as a package) outside the first three. None where none is."""
    torch = sys.modules.get("torch")
    torch_folder = os.path.join(os.path.dirname(torch.__file__ or ""), "") if torch else None

    def toolkit_or_torch(path: str) -> bool:
        # "<frozen importlib._bootstrap>", "<string>": the interpreter's, never the user's file
        frozen = path.startswith("<")
        return frozen or toolkit_frame(path) or bool(torch_folder and path.startswith(torch_folder))

    def installed(path: str) -> bool:
        return path.startswith(_INSTALLED) or any(part in path for part in _PACKAGE_FOLDERS)

    paths = [path if path.startswith("<") else os.path.abspath(path) for path in files]
    for index, path in enumerate(paths):
        if not toolkit_or_torch(path) and not installed(path):
            return index
    stdlib = os.path.join(sysconfig.get_paths()["stdlib"], "")
    for index, path in enumerate(paths):
        if not toolkit_or_torch(path) and not path.startswith(stdlib):
            return index
    return None


def report_failure(
    error: BaseException, label: str, hidden: Callable[[str], bool] | None = None
) -> int:
    """Print what ends this rank and return its exit code: its own (2) and one line for an
    HpcDdpError (one the same on every rank: by each host's first rank), 4 and one line when
    another rank went away, 130 for Ctrl-C, 8 and the traceback when the device failed, 2
    and the traceback with a HINT for an operation with no deterministic kernel under
    run.deterministic, else 1 and the traceback (without the leading frames ``hidden``
    names)."""
    if isinstance(error, HpcDdpError):
        line = f"[rank {label}] error: {error}"
        if not error.same_on_every_rank:
            print(line, file=sys.stderr)
            return error.exit_code
        late = (
            f"[rank {label}] error (its host's first rank had not said it within "
            f"{SAID_WAIT_S:.0f} s): {error}"
        )
        say_once_on_this_host(
            lambda: print(line, file=sys.stderr, flush=True),
            lambda: print(late, file=sys.stderr, flush=True),
            str(error),
        )
        return error.exit_code
    if isinstance(error, KeyboardInterrupt):
        print(f"[rank {label}] interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    unmatched = collective_timeout(error)
    if unmatched:
        print(f"[rank {label}] stopped: {unmatched}", file=sys.stderr)
        return EXIT_FAILURE
    peer_gone = lost_peer(error)
    if peer_gone:
        print(
            f"[rank {label}] stopped: another rank went away during a collective "
            f"({peer_gone[:300]}); that rank's output shows the cause",
            file=sys.stderr,
        )
        return EXIT_PEER_LOST
    text = user_traceback(error, hidden or (lambda _path: False))
    if no_deterministic_kernel(error):
        print(f"[rank {label}] failed:\n{text}HINT: run.deterministic=true asks every "
              "operation for a deterministic kernel and torch has none for this one: replace "
              "the operation, or set run.deterministic=false", file=sys.stderr)  # fmt: skip
        return EXIT_USER_ERROR
    device = device_failure(error)
    if device:
        print(f"[rank {label}] device failed ({device[:300]}); under slurm/train.sh its host "
              f"is left out and the job requeued\n{text}", file=sys.stderr, end="")  # fmt: skip
        return EXIT_DEVICE_ERROR
    print(f"[rank {label}] failed:\n{text}", file=sys.stderr, end="")
    return EXIT_FAILURE


#: gloo's words when a collective's partner never came within the group's timeout.
_GLOO_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms for (?:recv|send) operation")


def failure_record(error: BaseException) -> dict[str, object]:
    """What ended this rank, for the run's record of failures: the error in one line, the
    innermost line of the user's code it came through (None: none did), and whether it only
    followed another rank's end (a peer gone from a collective)."""
    follows = bool(lost_peer(error))
    if follows:
        said = "another rank went away during a collective"
    else:
        text = error.message if isinstance(error, HpcDdpError) else message_of(error)
        first = next((line.strip() for line in text.splitlines() if line.strip()), "")
        said = f"{type(error).__name__}: {first}" if first else type(error).__name__
    return {"error": said[:300], "at": _user_line(error), "follows_another_rank": follows}


def _user_line(error: BaseException) -> str | None:
    """The innermost line of the user's code ``error`` came through, as file:line in name."""
    frames = traceback.extract_tb(error.__traceback__)[::-1]
    index = innermost_user_frame([frame.filename for frame in frames])
    if index is None:
        return None
    return f"{frames[index].filename}:{frames[index].lineno} in {frames[index].name}"


def collective_timeout(error: BaseException) -> str | None:
    """What a gloo collective that timed out waited for, in words, with where the script
    called it (None for another error): every rank makes the same collectives, so one that
    never came means a rank skipped it, made another, or ran out of data sooner."""
    match = _GLOO_TIMEOUT.search(message_of(error)) if isinstance(error, RuntimeError) else None
    if match is None:
        return None
    called = _user_line(error)
    where = f", called at {called.rsplit(' in ', 1)[0]}" if called else ""
    return (
        f"a collective waited {int(match.group(1)) / 1000:g} s (dist.timeout_s) for the other "
        f"ranks{where}: another rank did not make the same call in that time (it is stuck "
        "or slower than that, skipped the call, made another, or its batches ran out "
        "sooner)\nHINT: every rank must make the same "
        "collective calls in the same order; one inside `if run.rank == 0` (run.sums()."
        "reduce(), run.full_state_dict) waits for ranks that never make it"
    )


def process_group_alive() -> bool:
    """True while torch.distributed has a process group (it is never imported for this)."""
    distributed = sys.modules.get("torch.distributed")
    return bool(
        distributed is not None and distributed.is_available() and distributed.is_initialized()
    )


def leave(code: int) -> NoReturn:
    """End the process now with ``code``: the exit handlers run and the streams are flushed
    as at a normal exit, the interpreter's teardown is skipped (see :func:`exit_process`)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_process(code: int) -> NoReturn:
    """End the process with ``code``, the documented one for how the rank ended.

    After a failed run the process group is still up (tearing it down could wait for a peer
    that is gone), and torch can then abort the process while the interpreter tears its
    modules down: gloo's threads outlive it ("terminate called without an active
    exception", SIGABRT), and the launcher sees 134 in place of ``code``. With a process
    group up, the process leaves without that teardown (:func:`leave`)."""
    if process_group_alive():
        leave(code)
    sys.exit(code)


def tell_elastic_agent(message: str, environ: Mapping[str, str], now: float) -> None:
    """Under torchrun, leave ``message`` where its agent reads why a rank ended (the error
    file it names in TORCHELASTIC_ERROR_FILE): its failure summary then shows it in place of
    a link about enabling tracebacks. Nothing elsewhere, or where the file cannot be written."""
    path = environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as record:
            json.dump({"message": message, "timestamp": int(now)}, record)
    except OSError:
        pass
