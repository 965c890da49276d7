"""`hpc-ddp init`: a project's first files, from the installed package alone: a ready job
script, its log folder and, on request, an example script or a built-in config to edit."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.cli.commands import program_arguments
from hpc_ddp.cli.jobs import check_builtin, job_request, write_job_script, written_script
from hpc_ddp.launch.program import Program
from hpc_ddp.launch.shipped import CONFIG_DIR, example_script, shipped_config_name
from hpc_ddp.runtime.errors import HpcDdpError


@dataclass(frozen=True)
class Copy:
    """A shipped file to place in the project."""

    source: Path
    target: Path


def requested_program(args: argparse.Namespace) -> Program:
    """The program given (checked: a script that exists, a config that loads), else the
    project's ./train.py, written now (--example) or later."""
    if not (args.target or args.config):
        return Program("script", "train.py")
    if args.example:
        raise HpcDdpError(
            "--example writes ./train.py for the job script to run, and a program was given too",
            "leave out --example, or the program",
        )
    program = program_arguments(args)
    check_builtin(program)
    return program


def planned_copies(
    args: argparse.Namespace, program: Program, cwd: Path
) -> tuple[list[Copy], Program]:
    """The example script (as ./train.py) and the shipped config (into ./configs/) that were
    asked for, and the program that runs the project's copy."""
    if args.example:
        return [Copy(example_script(args.example), cwd / "train.py")], program
    name = shipped_config_name(program.name) if program.kind == "builtin" else None
    if name is None or (cwd / program.name).is_file():
        return [], program
    target = Path("configs") / f"{name}.yaml"
    copy = Copy(CONFIG_DIR / f"{name}.yaml", cwd / target)
    return [copy], Program("builtin", str(target), program.args)


def init(args: argparse.Namespace) -> int:
    """Write the job script (never over an existing file), ./logs/ and the copies; say what
    was written and how to submit it."""
    from hpc_ddp.launch.sbatch import render_sbatch, template_path

    cwd = Path.cwd()
    output = Path(args.output)
    copies, program = planned_copies(args, requested_program(args), cwd)
    logs = cwd / "logs"
    for path in [output, *(copy.target for copy in copies), logs]:
        # A logs/ linked to a folder elsewhere (scratch space) is fine; a dangling one would
        # make its target.
        if path.is_symlink() and not (path == logs and path.is_dir()):
            raise HpcDdpError(
                f"{path} is a link (to {os.readlink(path)}): hpc-ddp init writes nothing "
                "through a link",
                "remove the link, or write the job script elsewhere with -o",
            )
        if path.exists() and path != logs:
            raise HpcDdpError(
                f"{path} exists already: hpc-ddp init leaves it as it is",
                "remove it, or write the job script elsewhere with -o",
            )
    request = job_request(args, program, logs, **written_script(args.output))
    text = render_sbatch(template_path().read_text(), request)
    try:
        logs.mkdir(exist_ok=True)
        for copy in copies:
            copy.target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(copy.source, copy.target)
        write_job_script(output, text)
    except OSError as error:
        raise HpcDdpError(
            f"hpc-ddp init cannot write {error.filename or cwd}: {error.strerror or error}",
            "run it in a project directory you can write to, where logs/ and configs/ are "
            "folders if they exist",
        ) from None
    for copy in copies:
        print(f"wrote {copy.target.relative_to(cwd)} (from {copy.source})", file=sys.stderr)
    print(
        f"wrote {output} (it runs {program}; its log goes to {logs}).\n"
        f"  try it here:  hpc-ddp local --nproc 2 {program}\n"
        f"  on Slurm:     sbatch {output}   (or: sbatch {output} other.py --lr 3e-4)",
        file=sys.stderr,
    )
    return 0
