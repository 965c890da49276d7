"""The names a run gives MLflow (metrics, text artifacts): checked when logged, by MLflow's
own rule, so one refused name never reaches the tracking server."""

from __future__ import annotations

import posixpath
import re

from hpc_ddp.runtime.errors import HpcDdpError

#: MLflow's limit on a metric key's length.
MAX_NAME_LENGTH = 250
_ALLOWED = re.compile(r"[/\w.\- :]+")
ALLOWED_TEXT = "letters, digits, '_', '-', '.', ' ', ':' and '/'"


def name_problem(name: object) -> str | None:
    """Why MLflow would refuse ``name`` as a metric key or an artifact's file name; None
    when it takes it."""
    if not isinstance(name, str) or not name:
        return f"a name is a non-empty string, not {name!r}"
    if len(name) > MAX_NAME_LENGTH:
        return f"{len(name)} characters long (at most {MAX_NAME_LENGTH})"
    if not _ALLOWED.fullmatch(name):
        wrong = sorted({char for char in name if not _ALLOWED.fullmatch(char)})
        return f"holds {''.join(wrong)!r}: only {ALLOWED_TEXT} are allowed"
    normal = posixpath.normpath(name)
    if normal != name or normal.startswith(("/", "..")) or normal == ".":
        return f"reads as the path {normal!r}: no leading '/', no '.' or '..' parts, no '//'"
    return None


def check_name(name: object, call: str) -> str:
    """``name`` when MLflow takes it; else an HpcDdpError naming ``call`` (``run.log``)."""
    problem = name_problem(name)
    if problem is not None:
        raise HpcDdpError(
            f"{call}({name!r}, ...): MLflow refuses this name: {problem}",
            f"name it with {ALLOWED_TEXT} (e.g. 'loss/top1' instead of 'loss@top1')",
        )
    return name  # type: ignore[return-value]
