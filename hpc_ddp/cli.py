"""`hpc-ddp`: one command over the toolkit's entry points.

hpc-ddp local --nproc 4 --config configs/digits.yaml train.epochs=3
hpc-ddp render --config configs/digits.yaml --nodes 2 --gpus-per-node 4 --time 02:00:00
hpc-ddp submit --config configs/digits.yaml --nodes 2 --gpus-per-node 4 --time 1:00:00
srun hpc-ddp doctor --config configs/digits.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from hpc_ddp.config import config_docs
from hpc_ddp.errors import HpcDdpError


def _train_args(args: argparse.Namespace) -> list[str]:
    return (
        (["--config", args.config] if args.config else [])
        + (["--dry-run"] if args.dry_run else [])
        + list(args.overrides)
    )


def _local(args: argparse.Namespace) -> int:
    from hpc_ddp.local import launch_local

    return launch_local(args.nproc, _train_args(args))


def _train(args: argparse.Namespace) -> int:
    from hpc_ddp.startup_signals import hold_stop_signals

    hold_stop_signals()
    from hpc_ddp.train import main as train_main

    return train_main(_train_args(args))


def _config(_args: argparse.Namespace) -> int:
    for key, default, doc in config_docs():
        print(f"{key} (default {default})\n    {doc}")
    return 0


def _render(args: argparse.Namespace) -> int:
    from hpc_ddp.config import load_config
    from hpc_ddp.sbatch import RenderRequest, render_sbatch, template_path

    load_config(args.config, args.overrides)  # a script for a config that cannot load is no use
    request = RenderRequest(
        config=args.config,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        cpu_tasks_per_node=args.tasks_per_node,
        cpus_per_task=args.cpus_per_task,
        time=args.time,
        partition=args.partition,
        job_name=args.job_name,
        overrides=tuple(args.overrides),
        launcher=args.launcher,
    )
    script = render_sbatch(template_path(args.launcher).read_text(), request)
    if args.output in (None, "-"):
        sys.stdout.write(script)
    else:
        Path(args.output).write_text(script)
        Path(args.output).chmod(0o755)
        print(f"wrote {args.output}: submit it with sbatch {args.output}", file=sys.stderr)
    return 0


def _submit(args: argparse.Namespace) -> int:
    from hpc_ddp.jobs import submit, wait

    job = submit(
        args.config,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        tasks_per_node=args.tasks_per_node,
        time=args.time,
        partition=args.partition,
        cpus_per_task=args.cpus_per_task,
        cluster=args.cluster,
        folder=args.folder,
        overrides=args.overrides,
    )
    print(f"submitted job {job.job_id} (logs in {args.folder})", file=sys.stderr)
    if args.no_wait:
        print(job.job_id)
        return 0
    results = wait(job)
    print(json.dumps(results[0], indent=2, sort_keys=True))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from hpc_ddp.config import load_config
    from hpc_ddp.doctor import diagnose, print_report

    return print_report(diagnose(load_config(args.config, args.overrides), os.environ))


def _data_make(args: argparse.Namespace) -> int:
    from hpc_ddp.datamake import make_dataset

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
    from hpc_ddp.slurm import derive_master_port

    if os.environ.get("MASTER_PORT"):
        print(os.environ["MASTER_PORT"])
        return 0
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if not job_id.isdigit():
        raise HpcDdpError(
            "SLURM_JOB_ID is not set, so there is no job to derive a port from",
            "run this inside a Slurm job, or set MASTER_PORT",
        )
    print(derive_master_port(int(job_id)))
    return 0


def _add_run_arguments(parser: argparse.ArgumentParser, dry_run: bool = True) -> None:
    parser.add_argument("--config", help="YAML config file")
    if dry_run:
        parser.add_argument("--dry-run", action="store_true", help="print the plan; do not train")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.epochs=3")


def _add_job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    parser.add_argument(
        "--gpus-per-node", type=int, default=0, help="GPUs per node = tasks per node (default 0)"
    )
    parser.add_argument(
        "--tasks-per-node", type=int, default=None, help="tasks per node without GPUs (default 1)"
    )
    parser.add_argument("--cpus-per-task", type=int, default=None, help="CPU cores per task")
    parser.add_argument("--time", default="01:00:00", help="time limit (default 01:00:00)")
    parser.add_argument("--partition", default=None, help="Slurm partition")


def _command(
    commands: argparse._SubParsersAction,  # type: ignore[type-arg]
    name: str,
    handler: Callable[[argparse.Namespace], int],
    help_text: str,
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(name, help=help_text)
    parser.set_defaults(handler=handler)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpc-ddp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    local = _command(commands, "local", _local, "train on N local CPU ranks (gloo, 127.0.0.1)")
    local.add_argument("--nproc", type=int, default=2, help="number of ranks (default 2)")
    _add_run_arguments(local)
    _add_run_arguments(_command(commands, "train", _train, "the entry point srun starts"))
    _command(commands, "config", _config, "list every config key with its default and doc")

    render = _command(commands, "render", _render, "write a ready sbatch script")
    _add_job_arguments(render)
    render.add_argument("--job-name", default=None, help="Slurm job name")
    render.add_argument("--launcher", choices=["srun", "torchrun"], default="srun")
    render.add_argument("--output", "-o", default=None, help="file to write (default stdout)")
    _add_run_arguments(render, dry_run=False)

    submit = _command(commands, "submit", _submit, "submit through submitit and wait")
    _add_job_arguments(submit)
    submit.add_argument("--cluster", choices=["slurm", "local"], default=None)
    submit.add_argument("--folder", default="logs/submitit", help="submitit's log folder")
    submit.add_argument("--no-wait", action="store_true", help="print the job id and return")
    _add_run_arguments(submit, dry_run=False)

    _add_run_arguments(
        _command(commands, "doctor", _doctor, "print each rank's plan and checks"), dry_run=False
    )
    _command(commands, "port", _port, "print this job's rendezvous port")

    data = _command(commands, "data", lambda _args: 2, "data tools")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    make = _command(data_commands, "make", _data_make, "write a Parquet set (train/ and val/)")
    make.add_argument("--kind", choices=["synthetic", "digits"], default="synthetic")
    make.add_argument("--rows", type=int, required=True, help="training rows")
    make.add_argument("--val-rows", type=int, default=None, help="validation rows (rows/10)")
    make.add_argument("--row-group-size", type=int, default=4096, help="rows per row group")
    make.add_argument("--files", type=int, default=1, help="files per split")
    make.add_argument("--features", type=int, default=64, help="synthetic: feature columns")
    make.add_argument("--classes", type=int, default=10, help="synthetic: classes")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--out", required=True, help="output directory")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "config", "") is None and args.command in ("render", "submit"):
        args.config = "configs/digits.yaml"
    if args.command == "render" and args.tasks_per_node is None:
        args.tasks_per_node = 1
    try:
        return int(args.handler(args))
    except HpcDdpError as error:
        print(f"hpc-ddp {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
