"""`hpc-ddp`: one command over the toolkit's launchers and tools.

hpc-ddp local --nproc 4 train.py --lr 3e-4                 your script on 4 local CPU ranks
hpc-ddp local --nproc 4 --config configs/digits.yaml train.epochs=3    the built-in trainer
hpc-ddp render --nodes 2 --gpus-per-node 4 --time 02:00:00 train.py -o job.sh
hpc-ddp submit --nodes 2 --gpus-per-node 4 --time 1:00:00 -m mypkg.train
srun hpc-ddp doctor --config configs/digits.yaml
hpc-ddp runs                     the runs under ./runs: state, step, newest metrics
hpc-ddp plot NAME/ID             their training and validation curves as a PNG
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from hpc_ddp.launch.program import Program, program_from
from hpc_ddp.runtime.errors import HpcDdpError

PROGRAM_HELP = (
    "what every rank runs: your script and its arguments (train.py --lr 3e-4), -m and a "
    "module, or the built-in trainer: a .yaml config (or --config) and dotted overrides"
)


def _split_options(
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


def _program(args: argparse.Namespace, default_config: str = "") -> Program:
    arguments = [args.target, *args.target_args] if args.target is not None else []
    program = program_from(
        arguments, module=args.module, config=args.config, default_config=default_config
    )
    if program.kind == "builtin" and program.args:
        options, overrides = _split_options(args.parser, list(program.args))
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


def _local(args: argparse.Namespace) -> int:
    from hpc_ddp.launch.local import launch_local

    return launch_local(args.nproc, _program(args))


def _run(args: argparse.Namespace) -> int:
    from hpc_ddp.runtime.startup_signals import hold_stop_signals

    hold_stop_signals()  # before the user's program imports torch
    from hpc_ddp.launch.program import run_program

    program = _program(args)
    if program.kind == "builtin":
        raise HpcDdpError(
            "hpc-ddp run starts your own script or module",
            "e.g. hpc-ddp run train.py --lr 3e-4; the built-in trainer is python -m hpc_ddp.train",
        )
    return run_program(program)


def _train(args: argparse.Namespace) -> int:
    from hpc_ddp.runtime.startup_signals import hold_stop_signals

    hold_stop_signals()
    from hpc_ddp.trainer.main import main as train_main

    config = ["--config", args.config] if args.config else []
    return train_main([*config, *(["--dry-run"] if args.dry_run else []), *args.overrides])


def _config(_args: argparse.Namespace) -> int:
    from hpc_ddp.trainer.config import config_docs

    for key, default, doc in config_docs():
        print(f"{key} (default {default})\n    {doc}")
    return 0


def _check_builtin(program: Program) -> None:
    """A script for a built-in config that cannot load is no use: load it now."""
    from hpc_ddp.trainer.config import load_config

    program.check()
    if program.kind == "builtin":
        load_config(program.name or None, program.args)


def _render(args: argparse.Namespace) -> int:
    from hpc_ddp.launch.sbatch import RenderRequest, render_sbatch, template_path

    program = _program(args, default_config="configs/digits.yaml")
    _check_builtin(program)
    request = RenderRequest(
        arguments=tuple(program.template_args()),
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        cpu_tasks_per_node=args.tasks_per_node or 1,
        cpus_per_task=args.cpus_per_task,
        time=args.time,
        partition=args.partition,
        job_name=args.job_name,
        launcher=args.launcher,
    )
    script = render_sbatch(template_path(args.launcher).read_text(), request)
    if args.output in (None, "-"):
        sys.stdout.write(script)
        return 0
    output = Path(args.output)
    if not output.parent.is_dir():
        raise HpcDdpError(
            f"cannot write {output}: the directory {output.parent} does not exist",
            f"create it first (mkdir -p {output.parent}) or pick another --output",
        )
    output.write_text(script)
    output.chmod(0o755)
    print(f"wrote {output}: submit it with sbatch {output}", file=sys.stderr)
    return 0


def _submit(args: argparse.Namespace) -> int:
    from hpc_ddp.launch.jobs import submit, wait

    program = _program(args, default_config="configs/digits.yaml")
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
    )
    print(f"submitted job {job.job_id} (logs in {args.folder})", file=sys.stderr)
    if args.no_wait:
        print(job.job_id)
        return 0
    results = wait(job)
    print(json.dumps(results[0], indent=2, sort_keys=True, default=str))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from hpc_ddp.launch.doctor import diagnose, print_report
    from hpc_ddp.trainer.config import load_config

    return print_report(diagnose(load_config(args.config, args.overrides), os.environ))


def _data_make(args: argparse.Namespace) -> int:
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


def _port(_args: argparse.Namespace) -> int:
    from hpc_ddp.runtime.slurm import derive_master_port

    if os.environ.get("MASTER_PORT"):
        from hpc_ddp.runtime.distenv import port_override

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


def _add_program_arguments(parser: argparse.ArgumentParser, dry_run: bool = False) -> None:
    parser.add_argument("--config", help="YAML config of the built-in trainer")
    if dry_run:
        parser.add_argument("--dry-run", action="store_true", help="built-in trainer: the plan")
    parser.add_argument("-m", dest="module", action="store_true", help="run a module")
    parser.add_argument("target", nargs="?", help=PROGRAM_HELP)
    parser.add_argument("target_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum`` (a clear usage error if not)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is too small: at least {minimum}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def _add_job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=_at_least(1), default=1, help="nodes (default 1)")
    parser.add_argument(
        "--gpus-per-node",
        type=_at_least(0),
        default=0,
        help="GPUs per node = tasks per node (default 0)",
    )
    parser.add_argument(
        "--tasks-per-node",
        type=_at_least(1),
        default=None,
        help="tasks per node without GPUs (default 1)",
    )
    parser.add_argument(
        "--cpus-per-task", type=_at_least(1), default=None, help="CPU cores per task"
    )
    parser.add_argument("--time", default="01:00:00", help="time limit (default 01:00:00)")
    parser.add_argument("--partition", default=None, help="Slurm partition")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hpc_ddp")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _command(
    commands: argparse._SubParsersAction,  # type: ignore[type-arg]
    name: str,
    handler: Callable[[argparse.Namespace], int],
    help_text: str,
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=help_text, description=help_text[:1].upper() + help_text[1:] + "."
    )
    parser.set_defaults(handler=handler, parser=parser)
    return parser


def _runs(args: argparse.Namespace) -> int:
    from hpc_ddp.view.runs import find_runs, format_runs

    found = find_runs(Path(args.output_dir))
    print(format_runs(found) if found else f"no runs in {args.output_dir}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from hpc_ddp.view.plot import save_plot
    from hpc_ddp.view.runs import find_run

    run = find_run(args.run, Path(args.output_dir))
    print(save_plot(run, Path(args.output) if args.output else None))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpc-ddp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"hpc-ddp {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    local = _command(commands, "local", _local, "run a program on N local CPU ranks (gloo)")
    local.add_argument("--nproc", type=_at_least(1), default=2, help="number of ranks (default 2)")
    _add_program_arguments(local, dry_run=True)
    run = _command(commands, "run", _run, "run your script or module as this rank (srun runs it)")
    _add_program_arguments(run)
    train = _command(commands, "train", _train, "the built-in trainer as this rank")
    train.add_argument("--config", help="YAML config file")
    train.add_argument("--dry-run", action="store_true", help="print the plan; do not train")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.epochs=3")
    _command(commands, "config", _config, "list every config key with its default and doc")

    render = _command(commands, "render", _render, "write a ready sbatch script")
    _add_job_arguments(render)
    render.add_argument("--job-name", default=None, help="Slurm job name")
    render.add_argument(
        "--launcher",
        choices=["srun", "torchrun"],
        default="srun",
        help="srun: one task per GPU (default); torchrun: one torchrun per node",
    )
    render.add_argument("--output", "-o", default=None, help="file to write (default stdout)")
    _add_program_arguments(render)

    submit = _command(commands, "submit", _submit, "submit through submitit and wait")
    _add_job_arguments(submit)
    submit.add_argument(
        "--cluster",
        choices=["slurm", "local"],
        default=None,
        help="slurm, or local (this machine); default: Slurm when sbatch is found",
    )
    submit.add_argument("--folder", default="logs/submitit", help="submitit's log folder")
    submit.add_argument("--no-wait", action="store_true", help="print the job id and return")
    _add_program_arguments(submit)

    doctor = _command(commands, "doctor", _doctor, "print each rank's plan and checks")
    doctor.add_argument("--config", help="YAML config file")
    doctor.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.epochs=3")
    _command(commands, "port", _port, "print this job's rendezvous port")

    runs = _command(commands, "runs", _runs, "list runs: state, step, newest metrics")
    runs.add_argument("output_dir", nargs="?", default="runs", help="run.output_dir (runs)")
    plot = _command(commands, "plot", _plot, "write a PNG of a run's curves (matplotlib)")
    plot.add_argument("run", help="a run directory, or NAME/ID or ID as `hpc-ddp runs` shows")
    plot.add_argument("--output-dir", default="runs", help="where to look for NAME/ID (runs)")
    plot.add_argument("--output", "-o", default=None, help="PNG to write (<run dir>/curves.png)")

    data = _command(commands, "data", lambda _args: 2, "data tools")
    data_commands = data.add_subparsers(dest="data_command", metavar="COMMAND", required=True)
    make = _command(data_commands, "make", _data_make, "write a Parquet set (train/ and val/)")
    make.add_argument(
        "--kind",
        choices=["synthetic", "digits"],
        default="synthetic",
        help="synthetic: deterministic rows of any size (default); digits: scikit-learn's",
    )
    make.add_argument("--rows", type=_at_least(1), required=True, help="training rows")
    make.add_argument(
        "--val-rows", type=_at_least(1), default=None, help="validation rows (rows/10)"
    )
    make.add_argument(
        "--row-group-size", type=_at_least(1), default=4096, help="rows per row group"
    )
    make.add_argument("--files", type=_at_least(1), default=1, help="files per split")
    make.add_argument(
        "--features", type=_at_least(1), default=64, help="synthetic: feature columns"
    )
    make.add_argument("--classes", type=_at_least(2), default=10, help="synthetic: classes")
    make.add_argument(
        "--seed", type=_at_least(0), default=0, help="random seed for the rows (default 0)"
    )
    make.add_argument("--out", required=True, help="output directory")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except HpcDdpError as error:
        print(f"hpc-ddp {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
