"""`hpc-ddp sweep`: many runs of one program as Slurm job arrays (see hpc_ddp.sweep).

hpc-ddp sweep submit SWEEP.yaml --concurrency 4 --nodes 1 --gpus-per-node 4 -- train.py --epochs 5
hpc-ddp sweep submit SWEEP.yaml --snapshot -- train.py    every task runs a copy taken now
hpc-ddp sweep submit --name lr --grid lr=0.1,0.01 --grid run.seed=1,2 -- train.py
hpc-ddp sweep status runs/lr       the tasks, best first
hpc-ddp sweep resume runs/lr       resubmit the tasks that did not finish (--set KEY=VALUE)
hpc-ddp sweep plot runs/lr         one metric of every task in one PNG
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from hpc_ddp.cli.snapshot import SNAPSHOT_HELP
from hpc_ddp.runtime.errors import HpcDdpError

AddCommand = Callable[..., argparse.ArgumentParser]


def add_sweep_commands(
    sweep: argparse.ArgumentParser,
    command: AddCommand,
    add_job_arguments: Callable[[argparse.ArgumentParser], None],
) -> None:
    """The `sweep` subcommands, under the `sweep` parser."""
    commands = sweep.add_subparsers(metavar="COMMAND", required=True)
    submit = command(commands, "submit", submit_command, "submit a sweep as Slurm job arrays")
    submit.add_argument("sweep_file", nargs="?", help="the sweep's YAML file (name, grid, ...)")
    submit.add_argument("--name", help="the sweep's name (its folder under --output-dir)")
    for kind in ("grid", "zip"):
        submit.add_argument(
            f"--{kind}",
            action="append",
            default=[],
            metavar="KEY=V1,V2",
            help=f"values of one key, added to the file's {kind} (repeatable)",
        )
    submit.add_argument("--concurrency", type=int, default=None, help="tasks at once (%%K)")
    submit.add_argument("--metric", default=None, help="the metric `sweep status` sorts by")
    submit.add_argument(
        "--output-dir", default=None, help="run.output_dir of the tasks (default: runs)"
    )
    submit.add_argument("--snapshot", action="store_true", help=SNAPSHOT_HELP)
    add_job_arguments(submit)
    submit.set_defaults(program=[])
    submit.epilog = "After the options: -- and what every task runs (train.py --epochs 5)."
    status = command(commands, "status", status_command, "a sweep's tasks, best first")
    status.add_argument("sweep_dir", help="the sweep's folder (<output dir>/<name>)")
    resume = command(
        commands, "resume", resume_command, "resubmit the tasks of a sweep that did not finish"
    )
    resume.add_argument("sweep_dir", help="the sweep's folder (<output dir>/<name>)")
    resume.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a new value for the resubmitted tasks: --set lr=0.05 (your --lr), --set "
        "train.epochs=4",
    )
    plot = command(commands, "plot", plot_command, "one metric of every task in one PNG")
    plot.add_argument("sweep_dir", help="the sweep's folder (<output dir>/<name>)")
    plot.add_argument("--metric", default=None, help="(default: the one status sorts by)")
    plot.add_argument("--output", "-o", default=None, help="PNG (default <sweep dir>/METRIC.png)")


def split_sweep_program(words: list[str]) -> tuple[list[str], list[str] | None]:
    """(hpc-ddp's words, the program's) of ``sweep submit ... -- PROGRAM ...``: everything
    after the first ``--`` is the program's, options and all."""
    if words[:2] != ["sweep", "submit"] or "--" not in words:
        return words, None
    at = words.index("--")
    return words[:at], words[at + 1 :]


def _spec(args: argparse.Namespace) -> Any:
    from hpc_ddp.runtime.yamlread import load_mapping
    from hpc_ddp.sweep.spec import parse_values, spec_from_dict

    raw: dict[str, Any] = load_mapping(args.sweep_file, "sweep file") if args.sweep_file else {}
    source = args.sweep_file or "the command line"
    if args.name:
        raw["name"] = args.name
    if args.concurrency is not None:
        raw["concurrency"] = args.concurrency
    if args.metric:
        raw["metric"] = args.metric
    for kind in ("grid", "zip"):
        for text in getattr(args, kind):
            key, values = parse_values(text, f"--{kind}")
            raw.setdefault(kind, {})
            if not isinstance(raw[kind], dict):
                raise HpcDdpError(
                    f"{source}: {kind} is not a mapping", f"e.g. {kind}: {{--lr: [1]}}"
                )
            raw[kind][key] = list(values)
    if "name" not in raw:
        raise HpcDdpError(f"{source}: the sweep has no name", "add name: ... or pass --name")
    return spec_from_dict(raw, source)


def submit_command(args: argparse.Namespace) -> int:
    from hpc_ddp.cli.api import trainer_settings
    from hpc_ddp.cli.jobs import check_builtin, job_request, warning_signal
    from hpc_ddp.cli.snapshot import take_snapshot_saying
    from hpc_ddp.sweep.programs import runtime_settings, sweep_program
    from hpc_ddp.sweep.submit import submit_sweep

    spec = _spec(args)
    program = sweep_program(args.program)
    config = check_builtin(program)
    request = job_request(args, program, Path("logs"), signal=warning_signal(None, config))
    output_dir = args.output_dir or runtime_settings(program, os.environ).run.output_dir
    # Every task, its requeues and a `sweep resume` run the copy: the record names it.
    hint = "set --output-dir to a folder you can write (the snapshot goes into the sweep's)"
    snapshot = partial(take_snapshot_saying, hint=hint) if args.snapshot else None
    sweep_dir = submit_sweep(
        spec, program, request, Path(output_dir), os.environ,
        snapshot=snapshot, trainer_settings=trainer_settings(),
    )  # fmt: skip
    print(f"sweep {spec.name}: {sweep_dir}  (hpc-ddp sweep status {sweep_dir})")
    return 0


def status_command(args: argparse.Namespace) -> int:
    from hpc_ddp.sweep.views import format_rows, sweep_status

    sweep_dir = Path(args.sweep_dir)
    data, rows, metric, mode, queue_read = sweep_status(sweep_dir, os.environ)
    print(f"sweep {data['name']} ({len(rows)} tasks) in {sweep_dir}")
    print(format_rows(rows, metric, mode))
    if not queue_read:
        print("(Slurm's queue could not be read: states are the sweep's record)", file=sys.stderr)
    return 0


def resume_command(args: argparse.Namespace) -> int:
    from hpc_ddp.cli.api import trainer_settings
    from hpc_ddp.sweep.resume import resume_sweep

    resume_sweep(
        Path(args.sweep_dir), args.settings, os.environ, trainer_settings=trainer_settings()
    )
    return 0


def plot_command(args: argparse.Namespace) -> int:
    from hpc_ddp.sweep.views import plot_sweep

    print(plot_sweep(Path(args.sweep_dir), args.metric, Path(args.output) if args.output else None))
    return 0
