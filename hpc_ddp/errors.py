"""The one exception type users see: what was seen, what was expected, and the fix."""

from __future__ import annotations


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
