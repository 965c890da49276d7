"""The one exception type users see (what was seen, what was expected, the fix), and the
exit codes every entry point uses."""

from __future__ import annotations

#: A crash: the rank's traceback is printed.
EXIT_FAILURE = 1
#: A problem with the input or the launch: a message with a HINT, no traceback.
EXIT_USER_ERROR = 2
#: Stopped on a signal after a checkpoint, and not requeued: run again to continue.
EXIT_STOPPED = 3


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
