"""What each `hpc-ddp` command does (the parser is in app.py)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_ddp.cli.snapshot import snapshot_if_asked
from hpc_ddp.launch.program import DEFAULT_CONFIG, Program, program_from
from hpc_ddp.launch.shipped import find_config
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.safefiles import folder_made

if TYPE_CHECKING:
    from hpc_ddp.launch.sbatch import RenderRequest
    from hpc_ddp.trainer.config import Config


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
    environ = with_settings(os.environ, args.settings)
    environ[LOCAL_COMMAND_VARIABLE] = shlex.join(local_words(args.nproc, args.settings, program))
    return launch_local(args.nproc, program, environ)


def local_words(nproc: int, settings: Sequence[str], program: Program) -> list[str]:
    """What follows ``hpc-ddp local`` to start ``program`` again as it was started."""
    words = [f"--nproc={nproc}", *(f"--set={setting}" for setting in settings)]
    if program.kind == "builtin":
        return [*words, *(["--config", program.name] if program.name else []), *program.args]
    return [*words, *program.template_args()]


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
    from hpc_ddp.trainer.config import config_docs

    for key, default, doc in config_docs():
        print(f"{key} (default {default})\n    {doc}")
    return 0


def check_builtin(program: Program) -> Config | None:
    """A script for a built-in config that cannot load is no use: load it now."""
    from hpc_ddp.trainer.config import load_config

    program.check()
    if program.kind == "builtin":
        config_file = find_config(program.name, Path.cwd()) if program.name else None
        return load_config(config_file, program.args)
    return None


def warning_signal(requested: str | None, config: Config | None) -> str:
    """--signal, else the built-in config's preempt.signal, else USR1; the two must agree."""
    if config is None:
        return requested or "USR1"
    configured = config.runtime.preempt.signal
    if requested is not None and requested != configured:
        raise HpcDdpError(
            f"--signal {requested} but the config's preempt.signal is {configured}: the ranks "
            f"would not handle the job's warning signal",
            f"drop --signal (the config's is used), or add preempt.signal={requested}",
        )
    return configured


def render(args: argparse.Namespace) -> int:
    from hpc_ddp.launch.sbatch import render_sbatch, template_path

    program = program_arguments(args, default_config=DEFAULT_CONFIG)
    config = check_builtin(program)
    # Slurm opens the job's log before the script runs and never creates its folder: name it
    # absolutely and create it now, so the job can be submitted from anywhere.
    log_dir = folder_made(
        Path(args.log_dir).resolve(), "the job's log folder",
        "pass --log-dir with a folder you can write, e.g. --log-dir ~/logs",
    )  # fmt: skip
    program = snapshot_if_asked(
        args.snapshot, program, log_dir / "snapshots",
        "pass --log-dir with a folder you can write (the snapshot goes into it)",
    )  # fmt: skip
    request = job_request(
        args,
        program,
        log_dir,
        job_name=args.job_name,
        launcher=args.launcher,
        signal=warning_signal(args.signal, config),
    )
    script = render_sbatch(template_path(args.launcher).read_text(), request)
    if args.output in (None, "-"):
        sys.stdout.write(script)
        return 0
    output = Path(args.output)
    write_job_script(output, script)
    print(
        f"wrote {output}: submit it with sbatch {output}; its log goes to {log_dir}",
        file=sys.stderr,
    )
    return 0


def job_request(
    args: argparse.Namespace, program: Program, log_dir: Path, **launch: Any
) -> RenderRequest:
    """What a job script is rendered from: the job's size and sbatch options from ``args``
    (render, init, sweep submit), ``program``, its log folder and ``launch`` (job name,
    launcher, signal)."""
    from hpc_ddp.launch.sbatch import RenderRequest

    options = sbatch_options(args)
    return RenderRequest(
        arguments=tuple(program.template_args()),
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        cpu_tasks_per_node=args.tasks_per_node or 1,
        cpus_per_task=args.cpus_per_task,
        time=args.time,
        partition=args.partition,
        log_dir=str(log_dir),
        sbatch_options=tuple(options.items()),
        **launch,
    )


def slurm_words(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """--slurm's options (None: a flag)."""
    from hpc_ddp.launch.slurmoptions import from_words

    return list(from_words(args.slurm).items())


def sbatch_options(args: argparse.Namespace) -> dict[str, str | None]:
    """The job's other sbatch options: the site profiles', then --slurm's; checked with this
    cluster's sbatch where there is one."""
    from hpc_ddp.launch.slurmoptions import check_with_sbatch, job_options

    options = job_options(getattr(args, "slurm", []), Path.cwd(), os.environ)
    check_with_sbatch(options, os.environ)
    return options


def write_job_script(output: Path, script: str) -> None:
    """``script`` at ``output``, executable; a path that cannot take it is one line."""
    if not output.parent.is_dir():
        raise HpcDdpError(
            f"cannot write {output}: the directory {output.parent} does not exist",
            f"create it first (mkdir -p {output.parent}) or pick another --output",
        )
    if output.is_dir():
        raise HpcDdpError(
            f"cannot write {output}: it is a directory", f"name a file, e.g. -o {output}/job.sh"
        )
    try:
        output.write_text(script)
        output.chmod(0o755)
    except OSError as error:
        raise HpcDdpError(
            f"cannot write {output}: {error.strerror or error}",
            "pick an --output in a folder of your own",
        ) from None


def submit(args: argparse.Namespace) -> int:
    from hpc_ddp.cli.api import submit
    from hpc_ddp.launch.jobs import wait

    program = program_arguments(args, default_config=DEFAULT_CONFIG)
    program = snapshot_if_asked(
        args.snapshot, program, Path(args.folder).resolve() / "snapshots",
        "pass --folder with a folder you can write (the snapshot goes into it)",
    )  # fmt: skip
    target: str | list[str] = program.template_args()
    overrides: list[str] = []
    if program.kind == "builtin":
        target, overrides = program.name, list(program.args)
    job = submit(
        target,
        overrides=overrides,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        tasks_per_node=args.tasks_per_node,
        time=args.time,
        partition=args.partition,
        cpus_per_task=args.cpus_per_task,
        cluster=args.cluster,
        folder=args.folder,
        # submit() adds the site profiles and checks the whole with sbatch: only --slurm here.
        sbatch={name: True if value is None else value for name, value in slurm_words(args)},
    )
    print(f"submitted job {job.job_id} (logs in {args.folder})", file=sys.stderr)
    if args.no_wait:
        print(job.job_id)
        return 0
    results = wait(job)
    print(json.dumps(results[0], indent=2, sort_keys=True, default=str))
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
