"""What `hpc-ddp`'s commands that run a program or print a fact do (the parser is in
:mod:`hpc_ddp.cli.parser`; a Slurm job's commands are in :mod:`hpc_ddp.cli.jobs`)."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_ddp.launch.program import DEFAULT_CONFIG, Program, program_from
from hpc_ddp.launch.shipped import find_config
from hpc_ddp.runtime.errors import HpcDdpError

if TYPE_CHECKING:
    pass


def split_options(
    parser: argparse.ArgumentParser, tokens: list[str]
) -> tuple[list[str], list[str]]:
    """(this command's options, the rest) of ``tokens``: the built-in trainer's overrides may
    come before options (`... train.epochs=5 -o job.sh`), which a user's program's arguments
    never share."""
    options: list[str] = []
    rest: list[str] = []
    actions = parser._option_string_actions
    index = 0
    while index < len(tokens):
        token = tokens[index]
        action = actions.get(token.split("=", 1)[0])
        if action is None:
            rest.append(token)
            index += 1
            continue
        size = 1 if action.nargs == 0 or "=" in token else 2
        options += tokens[index : index + size]
        index += size
    return options, rest


def program_arguments(args: argparse.Namespace, default_config: str = "") -> Program:
    arguments = [args.target, *args.target_args] if args.target is not None else []
    program = program_from(
        arguments, module=args.module, config=args.config, default_config=default_config
    )
    if program.kind == "builtin" and program.args:
        options, overrides = split_options(args.parser, list(program.args))
        if options:
            args.parser.parse_args(options, namespace=args)
            program = Program("builtin", program.name, tuple(overrides))
    if getattr(args, "dry_run", False):
        if program.kind != "builtin":
            raise HpcDdpError(
                "--dry-run applies to the built-in trainer",
                "leave it out for your own script, or check a launch with `hpc-ddp doctor`",
            )
        program = Program(program.kind, program.name, (*program.args, "--dry-run"))
    return program


def local(args: argparse.Namespace) -> int:
    from hpc_ddp.launch.local import launch_local
    from hpc_ddp.runtime.config import LOCAL_COMMAND_VARIABLE

    program = program_arguments(args, default_config=DEFAULT_CONFIG)
    note_misplaced("--nproc", "hpc-ddp local --nproc N", program)
    check_settings(args.settings, program, os.environ)
    environ = with_settings(os.environ, args.settings)
    environ[LOCAL_COMMAND_VARIABLE] = shlex.join(local_words(args.nproc, args.settings, program))
    return launch_local(args.nproc, program, environ)


def local_words(nproc: int, settings: Sequence[str], program: Program) -> list[str]:
    """What follows ``hpc-ddp local`` to start ``program`` again as it was started."""
    words = [f"--nproc={nproc}", *(f"--set={setting}" for setting in settings)]
    if program.kind == "builtin":
        return [*words, *(["--config", program.name] if program.name else []), *program.args]
    return [*words, *program.template_args()]


def note_misplaced(option: str, before: str, program: Program) -> None:
    """Say that hpc-ddp's ``option``, written after a script, goes to the script."""
    if program.kind != "builtin" and any(
        word == option or word.startswith(f"{option}=") for word in program.args
    ):
        print(
            f"note: {option} after {program.name} is passed to it as its own argument; "
            f"hpc-ddp's {option} goes before it: {before} {program.name} ...",
            file=sys.stderr,
        )


def check_settings(
    settings: Sequence[str],
    program: Program,
    environ: Mapping[str, str],
    after: Sequence[str] = (),
) -> None:
    """Refuse here, once and before any rank starts, a ``--set`` every rank would refuse: an
    unknown section or key (the nearest known one named), a value of the wrong type. The
    ranks' own settings are put around them as the ranks apply them ($HPC_DDP_OVERRIDES
    before, ``after`` next; for the built-in trainer, its config file first and the
    overrides after it last); where those fail without the ``--set`` ones, the ranks say so."""
    from hpc_ddp.runtime.config import environment_overrides, resolve_config

    note_misplaced("--set", "hpc-ddp ... --set KEY=VALUE", program)
    if not settings or (program.kind == "module" and program.name == "hpc_ddp.train"):
        return  # that module's config is in its own arguments: its ranks judge the whole
    earlier = environment_overrides(environ)
    builtin = program.kind == "builtin"

    def check(chosen: Sequence[str]) -> None:
        if builtin:
            from hpc_ddp.trainer.config import load_config

            config_file = find_config(program.name, Path.cwd()) if program.name else None
            load_config(config_file, [*earlier, *chosen, *after, *program.args])
        else:
            resolve_config(None, [*earlier, *chosen, *after], {}, {})

    if _refusal(check, []) is not None or (whole := _refusal(check, settings)) is None:
        return
    # The first setting wrong on its own, with its own answer; else they are wrong together.
    culprit, error = next(
        ((one, found) for one in settings if (found := _refusal(check, [one])) is not None),
        (None, whole),
    )
    shown = f"--set {culprit!r}" if culprit else "the --set settings together"
    # What the ranks would name as its source (<defaults>, override '...') is this --set.
    detail = re.sub(r"^(<[^>]*>( \+ overrides)?|[^:]+ \+ overrides|override '[^']*'): ", "",
                    error.message)  # fmt: skip
    theirs = "" if builtin else " (your script's own settings go after it, as arguments)"
    raise HpcDdpError(
        f"{shown}: {detail}",
        f"{error.hint}; `hpc-ddp config` lists every key with its default{theirs}",
    )


def _refusal(check: Callable[[Sequence[str]], None], chosen: Sequence[str]) -> HpcDdpError | None:
    try:
        check(chosen)
    except HpcDdpError as error:
        return error
    return None


def with_settings(environ: Mapping[str, str], settings: Sequence[str]) -> dict[str, str]:
    """``environ`` with dotted ``settings`` added to $HPC_DDP_OVERRIDES (after those already
    there, so they win); each must read KEY=VALUE."""
    from hpc_ddp.runtime.config import OVERRIDES_VARIABLE

    for setting in settings:
        key, equals, _value = setting.partition("=")
        if not equals or "." not in key or not key.replace(".", "").replace("_", "").isalnum():
            raise HpcDdpError(
                f"--set {setting!r} is not a dotted setting KEY=VALUE",
                "e.g. --set run.id=a --set checkpoint.every_steps=200 (hpc-ddp config lists "
                "the keys)",
            )
    joined = " ".join(shlex.quote(setting) for setting in settings)
    earlier = environ.get(OVERRIDES_VARIABLE, "")
    combined = f"{earlier} {joined}".strip()
    return {**environ, OVERRIDES_VARIABLE: combined} if settings else dict(environ)


def run(args: argparse.Namespace) -> int:
    from hpc_ddp.runtime.preempt.startup_signals import hold_stop_signals

    hold_stop_signals()  # before the user's program imports torch
    from hpc_ddp.launch.program import run_program
    from hpc_ddp.runtime.tracking.worker import prestart

    program = program_arguments(args)
    if program.kind == "builtin":
        raise HpcDdpError(
            "hpc-ddp run starts your own script or module",
            "e.g. hpc-ddp run train.py --lr 3e-4; the built-in trainer is python -m hpc_ddp.train",
        )
    prestart(os.environ, program.args)  # mlflow's import overlaps torch's (rank 0)
    return run_program(program)


def train(args: argparse.Namespace) -> int:
    from hpc_ddp.cli.entry import before_imports

    before_imports(os.environ, args.overrides, args.dry_run)
    from hpc_ddp.cli.train import main as train_main
    from hpc_ddp.runtime.import_gc import freeze_for_exit, freeze_imports

    freeze_imports()
    config = ["--config", args.config] if args.config else []
    code = train_main([*config, *(["--dry-run"] if args.dry_run else []), *args.overrides])
    freeze_for_exit()  # the command's last step: the process exits next
    return code


def config(_args: argparse.Namespace) -> int:
    from hpc_ddp.runtime import configfile
    from hpc_ddp.runtime.config import RuntimeConfig
    from hpc_ddp.trainer.config import config_docs

    runtime = configfile.docs(RuntimeConfig)
    print(
        "# Every run's settings: hpc_ddp.start(section={...}), --set KEY=VALUE, HPC_DDP_OVERRIDES"
    )
    for key, default, doc in runtime:
        print(f"{key} (default {default})\n    {doc}")
    defaults = {key: default for key, default, _doc in runtime}
    print("\n# The built-in trainer's own settings and defaults (hpc-ddp train --config NAME)")
    for key, default, doc in config_docs():
        if key not in defaults:
            print(f"{key} (default {default})\n    {doc}")
        elif default != defaults[key]:
            print(f"{key} (the trainer's default {default})")
    return 0


def doctor(args: argparse.Namespace) -> int:
    from hpc_ddp.launch.doctor import diagnose, print_report

    json_dir = Path(args.json_dir) if args.json_dir else None
    first = args.overrides[0] if args.overrides else ""
    if first and "=" not in first and args.config is None:  # a script, not the built-in trainer
        from hpc_ddp.runtime import configfile
        from hpc_ddp.runtime.config import RuntimeConfig, resolve_config

        Program("script", first).check()
        # The runtime's sections are hpc_ddp's; the rest of the command line is the script's.
        sections = tuple(f"{name}." for name in configfile.section_names(RuntimeConfig))
        settings = [a for a in args.overrides[1:] if "=" in a and a.startswith(sections)]
        runtime = resolve_config(None, settings, {}, os.environ)
        return print_report(diagnose(runtime, os.environ, Path(first).stem), json_dir, os.environ)
    from hpc_ddp.trainer.config import load_config

    config_file = find_config(args.config, Path.cwd()) if args.config else None
    config = load_config(config_file, args.overrides)
    batch = (config.data.batch_size, config.train.grad_accum_steps)
    report = diagnose(config.runtime, os.environ, "doctor", batch)
    return print_report(report, json_dir, os.environ)


def data_make(args: argparse.Namespace) -> int:
    from hpc_ddp.trainer.datamake import make_dataset

    written = make_dataset(
        args.kind,
        args.rows,
        args.row_group_size,
        Path(args.out),
        args.val_rows,
        args.files,
        args.features,
        args.classes,
        args.seed,
    )
    for split, paths in written.items():
        print(f"{split}: {len(paths)} file(s) in {Path(args.out) / split}")
    print(
        f"train with: data.kind=parquet data.train_path={Path(args.out) / 'train'} "
        f"data.val_path={Path(args.out) / 'val'}"
    )
    return 0


def port(_args: argparse.Namespace) -> int:
    from hpc_ddp.runtime.place.slurm import derive_master_port

    if os.environ.get("MASTER_PORT"):
        from hpc_ddp.runtime.place.distenv import port_override

        print(port_override(os.environ, None))  # checked: a number from 1 to 65535
        return 0
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if not job_id.isdigit():
        raise HpcDdpError(
            "SLURM_JOB_ID is not set, so there is no job to derive a port from",
            "run this inside a Slurm job, or set MASTER_PORT",
        )
    print(derive_master_port(int(job_id)))
    return 0
