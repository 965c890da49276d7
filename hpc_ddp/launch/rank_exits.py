"""What the ranks' exit codes mean to a launcher: which rank's failure ends a local run
and how it is told (a rank that lost a peer is a consequence; one ended by a signal is named
by it), and a torchrun agent's exit code as ``hpc-ddp local`` would give it."""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from typing import Any

from hpc_ddp.runtime.errors import EXIT_PEER_LOST, EXIT_STOPPED

#: How long a rank that lost a peer waits for the rank that went away to be seen exiting: as
#: long as a stalled rank may take to end once its watchdog fires (the others' liveness read
#: twice, its turn to write, its run ended: each bounded by the watchdog, 33 s in all), so
#: that the cause is named, not the consequence, however busy the machine. Only a rank that
#: hangs without ending makes the launcher wait it out (one that is stopped is not waited for).
PEER_GRACE_S = 40.0


def failure_to_report(
    codes: Sequence[int | None], lost_peer_for_s: float, stopped: Sequence[int] = ()
) -> tuple[int, int] | None:
    """The (rank, exit code) that ends the run, or None to keep waiting.

    ``codes`` are the ranks' exit codes so far (None: running); ``stopped``: running ranks
    whose process is stopped (SIGSTOP), which cannot end by themselves. A rank that lost a
    peer (EXIT_PEER_LOST) is a consequence and often exits before the rank that went away,
    so the cause is waited for, up to PEER_GRACE_S while it can still end, and named instead.
    A rank that stopped on a signal after the common checkpoint (EXIT_STOPPED) is no failure.
    """
    failed = [
        (rank, code)
        for rank, code in enumerate(codes)
        if code is not None and code not in (0, EXIT_STOPPED)
    ]
    causes = [(rank, code) for rank, code in failed if code != EXIT_PEER_LOST]
    if causes:
        return causes[0]
    may_end = [rank for rank, code in enumerate(codes) if code is None and rank not in stopped]
    if failed and (lost_peer_for_s >= PEER_GRACE_S or not may_end):
        return failed[0]
    return None


def failure_line(
    rank: int, code: int, codes: Sequence[int | None], stopped: Sequence[int] = ()
) -> str:
    """What the launcher says of the failure that ends the run. A rank that lost contact
    with a peer names the rank that left early when one ended well (0, or stopped) while
    the others trained on (``sys.exit`` inside the loop): that one is the cause; else a
    rank whose process is ``stopped``."""
    if code < 0:
        return f"rank {rank} {killed_by(-code)}"
    if code != EXIT_PEER_LOST:
        return f"rank {rank} exited with code {code}"
    if stopped and not [done for done in codes if done in (0, EXIT_STOPPED)]:
        return (
            f"rank {stopped[0]}'s process is stopped (SIGSTOP: it does not run), "
            f"and rank {rank} lost contact with it (exit code {code})"
        )
    early = [(other, done) for other, done in enumerate(codes) if done in (0, EXIT_STOPPED)]
    if early:
        other, done = early[0]
        return (
            f"rank {other} left the run early (exit code {done}) while the others trained "
            f"on, and rank {rank} lost contact with it"
        )
    return f"rank {rank} exited with code {code} (it lost contact with another rank)"


def killed_by(number: int) -> str:
    """How a rank ended by signal ``number`` is told (exit code 128 + number)."""
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    said = f"was ended by {name} (exit code {128 + number})"
    if number == signal.SIGABRT:
        said += (
            ": an abort in native code (its last lines above say where; gloo's 'collective "
            "mismatch' means the ranks called different collectives, such as a wrapped "
            "model's forward on one rank only)"
        )
    return said


#: What torchrun's agent exits with when a worker exited with another code than 0 (the stop's
#: own code included: torchrun reports it as a failed worker).
TORCHRUN_WORKER_FAILED = 1


def stop_code(
    code: int, status: Mapping[str, Any] | None, launched_unix: float, at_step: int
) -> int:
    """A run's exit code under torchrun as ``hpc-ddp local`` gives it: torchrun reports any
    worker's non-zero exit as its own 1, the stop's included, so a 1 is the stop's code where
    the run's record (``status``) says this launch stopped at ``at_step`` (written after it
    began: a launch that failed before writing leaves the earlier stop's record)."""
    if code != TORCHRUN_WORKER_FAILED or status is None:
        return code
    updated = status.get("updated")
    stopped_here = (
        status.get("state") == "stopped"
        and status.get("global_step") == at_step
        and isinstance(updated, int | float)
        and updated >= launched_unix
    )
    return EXIT_STOPPED if stopped_here else code
