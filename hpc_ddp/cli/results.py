"""The commands that read a run's results: runs, plot, export, tracking sync."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def runs(args: argparse.Namespace) -> int:
    from hpc_ddp.runtime.errors import HpcDdpError
    from hpc_ddp.runtime.tracking.record import STATUS_FILE
    from hpc_ddp.view.runs import find_run, find_runs, format_run, format_runs

    given = Path(args.output_dir)
    if (given / STATUS_FILE).is_file() or (not given.exists() and Path("runs").is_dir()):
        try:  # a run directory, or NAME/ID or ID under ./runs
            run = find_run(args.output_dir, Path("runs"))
        except HpcDdpError as error:
            named = [each for each in find_runs(Path("runs")) if each.name == args.output_dir]
            if named:  # a NAME under ./runs: its runs
                print(format_runs(named))
                return 0
            raise HpcDdpError(
                f"no such directory: {given}, and {error.message}",
                "pass the run.output_dir your runs write to (default: runs), or one run as NAME/ID",
            ) from None
        print(format_run(run))
        return 0
    damaged: list[str] = []
    found = find_runs(Path(args.output_dir), damaged)
    print(format_runs(found) if found else f"no runs in {args.output_dir}")
    for line in damaged:
        print(f"hpc-ddp runs: skipped {line}", file=sys.stderr)
    return 0


def plot(args: argparse.Namespace) -> int:
    from hpc_ddp.view.runs import find_run

    run = find_run(args.run, Path(args.output_dir))
    output = Path(args.output) if args.output else None
    if args.goodput:
        from hpc_ddp.view.goodput import save_goodput_plot

        print(save_goodput_plot(run, output))
    else:
        from hpc_ddp.view.plot import save_plot

        print(save_plot(run, output))
    return 0


def tracking_sync(args: argparse.Namespace) -> int:
    from hpc_ddp.runtime.tracking.sync import sync_run
    from hpc_ddp.view.runs import find_run

    run = find_run(args.run, Path(args.output_dir)).path
    report = sync_run(run, args.uri)
    made = "a new MLflow run" if report.created else "MLflow run"
    print(
        f"synced {run} into {made} {report.run_id} at {report.uri}: {report.added} points "
        f"added, {report.already} already there"
        + (f"; status {report.status}" if report.status else "")
    )
    if report.refused:
        print(
            f"skipped metrics MLflow refuses by name: {', '.join(report.refused)}",
            file=sys.stderr,
        )
    return 0


def export(args: argparse.Namespace) -> int:
    from hpc_ddp.runtime.checkpoint.export import check_export_target, export_model
    from hpc_ddp.view.runs import find_run

    run = find_run(args.run, Path(args.output_dir)).path
    check_export_target(Path(args.output), run)
    checkpoint, name, count = export_model(run, Path(args.output), args.step, args.object)
    print(f"wrote {args.output}: {name!r} ({count} tensors) from {checkpoint}")
    return 0
