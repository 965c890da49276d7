"""The one exception type users see (what was seen, what was expected, the fix), and the
exit codes every entry point uses."""

from __future__ import annotations

#: A crash: the rank's traceback is printed.
EXIT_FAILURE = 1
#: A problem with the input or the launch: a message with a HINT, no traceback.
EXIT_USER_ERROR = 2
#: Stopped on a signal after a checkpoint, and not requeued: run again to continue.
EXIT_STOPPED = 3
#: A collective failed because another rank went away: a consequence; that rank's own
#: output shows the cause.
EXIT_PEER_LOST = 4

#: What gloo and NCCL say when the other end of a collective has gone (crashed, killed).
PEER_LOST_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote process exited or there was a network error",
)


def lost_peer(error: BaseException) -> str | None:
    """The line of ``error`` (or of an exception it came from) that says another rank went
    away, or None."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for line in str(current).splitlines():
            if any(marker in line for marker in PEER_LOST_MARKERS):
                return line
        current = current.__cause__ or current.__context__
    return None


class HpcDdpError(Exception):
    """A problem with the user's input or environment that the user can fix.

    The entry points print it as ``error: <message>`` followed by ``HINT: <hint>`` and exit
    non-zero, without a traceback.
    """

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message}\nHINT: {self.hint}"
        return self.message
