"""`hpc-ddp render` and `hpc-ddp submit`: a Slurm job from the command line, and the parts
`init` and `sweep submit` share (the job's request, its warning signal, its script file)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_ddp.cli.commands import program_arguments
from hpc_ddp.cli.snapshot import snapshot_if_asked
from hpc_ddp.launch.program import DEFAULT_CONFIG, Program
from hpc_ddp.launch.shipped import find_config
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.safefiles import folder_made

if TYPE_CHECKING:
    from hpc_ddp.launch.sbatch import RenderRequest
    from hpc_ddp.trainer.config import Config


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
        **written_script(args.output),
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


def written_script(output: str | None) -> dict[str, str | None]:
    """What a job script written for a project holds of where it was written: its name, the
    folder it works in and the python that wrote it (the one with hpc_ddp installed)."""
    return {
        # As given: the header's `sbatch <it>` lines hold where it was written.
        "script_name": output if output not in (None, "-") else "job.sh",
        "workdir": str(Path.cwd()),
        "python": sys.executable or None,
    }


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
