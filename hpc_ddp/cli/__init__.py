"""The command lines on top of the toolkit: ``hpc-ddp`` (:mod:`hpc_ddp.cli.app`, its parser
in :mod:`hpc_ddp.cli.parser`, its commands in :mod:`hpc_ddp.cli.commands` and
:mod:`hpc_ddp.cli.jobs`) and the built-in trainer's ``python -m hpc_ddp.train``
(:mod:`hpc_ddp.cli.train`). Nothing here is imported until a command runs."""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """``hpc-ddp``'s entry point (see :mod:`hpc_ddp.cli.app`)."""
    from hpc_ddp.cli.app import main as run_command

    return run_command(argv)
