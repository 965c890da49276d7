"""`hpc-ddp`'s command line: its commands, their arguments and their help."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from hpc_ddp.cli import commands as cmd
from hpc_ddp.cli import jobs, results
from hpc_ddp.cli.check_resume import add_arguments as add_check_resume_arguments
from hpc_ddp.cli.check_resume import check_resume
from hpc_ddp.cli.snapshot import SNAPSHOT_HELP
from hpc_ddp.cli.sweeps import add_sweep_commands
from hpc_ddp.launch.shipped import EXAMPLES

#: What ``hpc-ddp --help`` shows above the commands.
USAGE = """\
`hpc-ddp`: one command over the toolkit's launchers and tools.

hpc-ddp init --gpus-per-node 4   a project's job script (./train.sh) and ./logs/
hpc-ddp init --example lm        ... and a shipped example as ./train.py to start from
hpc-ddp local --nproc 4 train.py --lr 3e-4                 your script on 4 local CPU ranks
hpc-ddp local --nproc 4 --config configs/digits.yaml train.epochs=3    the built-in trainer
hpc-ddp render --nodes 2 --gpus-per-node 4 --time 02:00:00 -o job.sh train.py
hpc-ddp submit --nodes 2 --gpus-per-node 4 --time 1:00:00 -m mypkg.train
srun hpc-ddp doctor train.py     each rank's plan and checks (or --config for the trainer)
hpc-ddp runs                     the runs under ./runs: state, step, newest metrics
hpc-ddp plot NAME/ID             their training and validation curves as a PNG
                                 (--goodput: where each attempt's time went)
hpc-ddp tracking sync NAME/ID    replay a run's record into MLflow after an outage
hpc-ddp sweep submit SWEEP.yaml -- train.py   many runs as Slurm job arrays (sweep status,
                                 sweep resume, sweep plot)
"""

PROGRAM_HELP = (
    "what every rank runs: your script and its arguments (train.py --lr 3e-4), -m and a "
    "module, or the built-in trainer: a .yaml config (or --config) and dotted overrides"
)


def _add_program_arguments(parser: argparse.ArgumentParser, dry_run: bool = False) -> None:
    parser.add_argument(
        "--config",
        help="YAML config of the built-in trainer, or a shipped one by name (e.g. digits)",
    )
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
    parser.add_argument(
        "--slurm",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other sbatch option, e.g. --slurm account=lab --slurm qos=high --slurm "
        "exclusive (repeat it); wins over the site profile (slurm/site.yaml, "
        "~/.config/hpc_ddp/site.yaml)",
    )


def _init(args: argparse.Namespace) -> int:
    from hpc_ddp.cli.project import init

    return init(args)


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpc-ddp", description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"hpc-ddp {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    local = _command(commands, "local", cmd.local, "run a program on N local CPU ranks (gloo)")
    local.add_argument("--nproc", type=_at_least(1), default=2, help="number of ranks (default 2)")
    local.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a dotted setting for the ranks (e.g. --set run.id=a), whatever the program's own "
        "arguments; given to them in $HPC_DDP_OVERRIDES",
    )
    _add_program_arguments(local, dry_run=True)
    run = _command(
        commands, "run", cmd.run, "run your script or module as this rank (srun runs it)"
    )
    _add_program_arguments(run)
    train = _command(commands, "train", cmd.train, "the built-in trainer as this rank")
    train.add_argument("--config", help="YAML config file")
    train.add_argument("--dry-run", action="store_true", help="print the plan; do not train")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.epochs=3")
    _command(commands, "config", cmd.config, "list every config key with its default and doc")

    init = _command(
        commands,
        "init",
        _init,
        "write ./train.sh, a ready job script, and ./logs/ here (an example script or a "
        "built-in config too, on request)",
    )
    _add_job_arguments(init)
    init.add_argument("--output", "-o", default="train.sh", help="the job script (train.sh)")
    init.add_argument(
        "--example",
        choices=sorted(EXAMPLES),
        help="copy this shipped example script to ./train.py, for the job script to run",
    )
    _add_program_arguments(init)

    render = _command(commands, "render", jobs.render, "write a ready sbatch script")
    _add_job_arguments(render)
    render.add_argument("--job-name", default=None, help="Slurm job name")
    render.add_argument(
        "--launcher",
        choices=["srun", "torchrun"],
        default="srun",
        help="srun: one task per GPU (default); torchrun: one torchrun per node",
    )
    render.add_argument(
        "--signal",
        choices=["USR1", "USR2", "URG", "HUP", "INT", "ALRM"],
        default=None,
        help="Slurm's warning signal 120 s before the time limit (default: the config's "
        "preempt.signal, else USR1); it must be the one the ranks handle",
    )
    render.add_argument("--output", "-o", default=None, help="file to write (default stdout)")
    render.add_argument(
        "--log-dir",
        default="logs",
        help="folder for the job's log, created now and written as an absolute path "
        "(default ./logs)",
    )
    render.add_argument("--snapshot", action="store_true", help=SNAPSHOT_HELP)
    _add_program_arguments(render)

    submit = _command(commands, "submit", jobs.submit, "submit through submitit and wait")
    _add_job_arguments(submit)
    submit.add_argument(
        "--cluster",
        choices=["slurm", "local"],
        default=None,
        help="slurm, or local (this machine); default: Slurm when sbatch is found",
    )
    submit.add_argument("--folder", default="logs/submitit", help="submitit's log folder")
    submit.add_argument("--no-wait", action="store_true", help="print the job id and return")
    submit.add_argument("--snapshot", action="store_true", help=SNAPSHOT_HELP)
    _add_program_arguments(submit)

    doctor = _command(commands, "doctor", cmd.doctor, "print each rank's plan and checks")
    doctor.add_argument("--config", help="YAML config file")
    doctor.add_argument(
        "--json-dir",
        default=None,
        help="also write each rank's whole report as JSON to DIR/doctor-rank-<rank>.json",
    )
    doctor.add_argument(
        "overrides",
        nargs=argparse.REMAINDER,
        help="your script and its arguments (train.py --lr 3e-4 dist.timeout_s=60), or the "
        "built-in trainer's dotted overrides (train.epochs=3)",
    )
    _command(commands, "port", cmd.port, "print this job's rendezvous port")

    check = _command(
        commands,
        "check-resume",
        check_resume,
        "prove a resume exact on your script: run it never stopped and stopped-then-resumed "
        "on local ranks, and compare what both saved and logged",
    )
    add_check_resume_arguments(check, _at_least)
    _add_program_arguments(check)

    runs = _command(
        commands, "runs", results.runs, "list runs: state, step, goodput, newest metrics"
    )
    runs.add_argument(
        "output_dir",
        nargs="?",
        default="runs",
        help="run.output_dir (runs); or one run (its directory, or NAME/ID under runs): its "
        "line, each attempt's code and environment, where each attempt's time went, and "
        "what ended each attempt that failed (the rank, its error, where in your code)",
    )
    plot = _command(commands, "plot", results.plot, "write a PNG of a run's curves (matplotlib)")
    plot.add_argument("run", help="a run directory, or NAME/ID or ID as `hpc-ddp runs` shows")
    plot.add_argument("--output-dir", default="runs", help="where to look for NAME/ID (runs)")
    plot.add_argument(
        "--output", "-o", default=None,
        help="PNG to write (<run dir>/curves.png, or goodput.png with --goodput)",
    )  # fmt: skip
    plot.add_argument(
        "--goodput", action="store_true",
        help="draw where each attempt's allocation went instead: one bar per attempt on the "
        "run's clock (gaps: the queue), split into start-up, resume, steps, redone, "
        "checkpoints, evaluation, the stop or end, suspended and other",
    )  # fmt: skip

    export = _command(
        commands, "export", results.export, "write a model's weights from a checkpoint as one file"
    )
    export.add_argument("run", help="a run directory, or NAME/ID or ID as `hpc-ddp runs` shows")
    export.add_argument("--output-dir", default="runs", help="where to look for NAME/ID (runs)")
    export.add_argument("--step", type=_at_least(0), default=None, help="(default: newest)")
    export.add_argument("--object", default=None, help="registered model (default: the only)")
    export.add_argument("--output", "-o", required=True, help="the file to write, e.g. model.pt")
    tracking = _command(commands, "tracking", lambda _args: 2, "MLflow tools")
    tracking_commands = tracking.add_subparsers(metavar="COMMAND", required=True)
    sync = _command(
        tracking_commands,
        "sync",
        results.tracking_sync,
        "replay a run's own record (metrics.jsonl, summary, final state) into MLflow, into "
        "the same MLflow run, skipping points already there",
    )
    sync.add_argument("run", help="a run directory, or NAME/ID or ID as `hpc-ddp runs` shows")
    sync.add_argument("--output-dir", default="runs", help="where to look for NAME/ID (runs)")
    sync.add_argument("--uri", default=None, help="MLflow tracking URI (default: the run's)")

    sweep = _command(commands, "sweep", lambda _args: 2, "many runs of one program as job arrays")
    add_sweep_commands(sweep, _command, _add_job_arguments)

    data = _command(commands, "data", lambda _args: 2, "data tools")
    data_commands = data.add_subparsers(dest="data_command", metavar="COMMAND", required=True)
    make = _command(data_commands, "make", cmd.data_make, "write a Parquet set (train/ and val/)")
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
