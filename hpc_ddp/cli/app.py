"""`hpc-ddp`: reads the command line (:mod:`hpc_ddp.cli.parser` lists the commands) and
runs the command, an error of the toolkit's own said in one line with its exit code."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import os
import re
import sys
from collections.abc import Sequence

from hpc_ddp.cli.parser import build_parser
from hpc_ddp.cli.sweeps import split_sweep_program
from hpc_ddp.runtime.errors import HpcDdpError

#: Stands for a ``--`` after the program while argparse reads the line (it would drop it).
KEPT_SEPARATOR = "\0--"


def keep_programs_separator(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with a ``--`` that follows the program's name kept for the program, as
    ``python train.py -- --lr 3`` keeps it; one before the program ends hpc-ddp's options."""
    if "--" not in argv:
        return argv
    at = argv.index("--")
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            head, _rest = parser.parse_known_args(argv[:at])
        except SystemExit:
            return argv
    if getattr(head, "target", None) is None:
        return argv
    return [*argv[:at], KEPT_SEPARATOR, *argv[at + 1 :]]


#: Said where a command that starts a program got an option it does not know.
PROGRAM_OPTIONS_HINT = (
    "\nHINT: hpc-ddp's options go before the program and the program's own after it: "
    "hpc-ddp {command} train.py --epochs 3"
)
#: How each command that starts a program is written with hpc-ddp's options before it.
PROGRAM_EXAMPLES = {
    "local": "local --nproc 2",
    "check-resume": "check-resume --steps 40",
    "render": "render --nodes 2 -o job.sh",
    "submit": "submit --nodes 2",
    "init": "init",
    "run": "run",
}
SWEEP_PROGRAM_HINT = (
    "\nHINT: the sweep's program goes after --: "
    "hpc-ddp sweep submit sweep.yaml -- train.py --epochs 3"
)


def program_options_hint(
    words: Sequence[str], args: argparse.Namespace, sweep_program: Sequence[str] | None
) -> str:
    """The HINT for words hpc-ddp does not know on a command that starts a program ("" on
    one that starts none, and on a sweep whose program is after its -- already)."""
    if list(words[:2]) == ["sweep", "submit"]:
        return SWEEP_PROGRAM_HINT if sweep_program is None else ""
    if not hasattr(args, "target"):
        return ""
    example = PROGRAM_EXAMPLES.get(args.command, args.command)
    return PROGRAM_OPTIONS_HINT.format(command=example)


def misspelt_options(words: Sequence[str], command: argparse.ArgumentParser) -> dict[str, str]:
    """Of ``words`` (unknown to ``command``), each option that is a misspelling of one of
    its own, and that option (``--nprocs``: ``--nproc``; ``--epochs``: nothing of
    hpc-ddp's). Its own are those its usage line lists, not the examples of its help."""
    known = sorted(set(re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", command.format_usage())))
    meant = {}
    for word in words:
        name = word.partition("=")[0]
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        if name.startswith("--") and near:
            meant[word] = near[0]
    return meant


#: Commands whose ranks or jobs start in the working directory.
LAUNCHING_COMMANDS = ("local", "run", "train", "render", "submit", "sweep", "doctor")


def _working_directory_exists() -> bool:
    try:
        os.getcwd()
    except FileNotFoundError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    words, sweep_program = split_sweep_program(words)
    args, unknown = parser.parse_known_args(keep_programs_separator(parser, words))
    if unknown:
        misspelt = misspelt_options(unknown, args.parser)
        named = [f"{near}, not {word.partition('=')[0]}" for word, near in misspelt.items()]
        where = f"\nHINT: {args.parser.prog} has {'; '.join(named)}" if misspelt else ""
        if any(word.startswith("-") and word not in misspelt for word in unknown):
            # the options not misspelt may be the program's own
            where += program_options_hint(words, args, sweep_program)
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{where}")
    if sweep_program is not None:
        args.program = sweep_program
    if getattr(args, "target_args", None):
        args.target_args = ["--" if word == KEPT_SEPARATOR else word for word in args.target_args]
    if args.command in LAUNCHING_COMMANDS and not _working_directory_exists():
        print(
            f"hpc-ddp {args.command}: error: the working directory no longer exists (it was "
            "removed after this shell entered it)\nHINT: cd to an existing directory (cd "
            '"$PWD" enters the new one of the same name, if any), then run the command again',
            file=sys.stderr,
        )
        return 2
    try:
        code = int(args.handler(args))
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return code
    except HpcDdpError as error:
        print(f"hpc-ddp {args.command}: error: {error}", file=sys.stderr)
        return error.exit_code
    except BrokenPipeError:  # `hpc-ddp runs | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
