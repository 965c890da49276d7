"""``hpc-ddp check-resume``: proves a resume exact on the user's own script. It runs the script
on local ranks twice for the same steps, once never stopped and once stopped at a step (an
agreed stop with a checkpoint, as on a preemption) and resumed, then compares what both
saved and logged (:mod:`hpc_ddp.view.resume_check`). The ranks start as ``hpc-ddp local``
starts them, or under torchrun (``--launcher torchrun``), the launcher of the torchrun job
template."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.cli.commands import check_settings, local_words, program_arguments, with_settings
from hpc_ddp.launch.program import DEFAULT_CONFIG, Program
from hpc_ddp.launch.rank_exits import stop_code
from hpc_ddp.runtime.errors import EXIT_STOPPED, HpcDdpError
from hpc_ddp.runtime.safefiles import folder_made
from hpc_ddp.runtime.tracking.record import read_status

#: The exit code of a check that found a difference (bad input exits 2).
EXIT_DIFFERS = 1
#: The check's three runs, each with its log ``<folder>/<phase>.log``.
PHASES = ("straight", "stopped", "resumed")
#: --world-size-change's default tolerance (torch.isclose's rtol and atol).
RTOL, ATOL = 1e-3, 1e-5


def _launch(
    args: argparse.Namespace,
    program: Program,
    folder: Path,
    common: Sequence[str],
    run_id: str,
    stop_at: int,
    phase: str,
    nproc: int | None = None,
) -> tuple[int, float]:
    """Run ``run_id`` of the program to ``stop_at`` on ``nproc`` ranks (default --nproc)
    started by --launcher, with the user's settings and then ``common`` (which win), its
    output kept in ``<folder>/<phase>.log``: its exit code (as ``hpc-ddp local`` gives it;
    see :func:`stop_code`) and how long it ran."""
    settings = [*args.settings, *common, f"run.id={run_id}", f"preempt.stop_at_step={stop_at}"]
    ranks = nproc or args.nproc
    environ = check_environment(os.environ)
    if args.launcher == "torchrun":
        environ = with_settings(environ, settings)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={ranks}", "--max-restarts=0",
                   *program.python_args()]  # fmt: skip
    else:
        command = [sys.executable, "-m", "hpc_ddp", "local",
                   *local_words(ranks, settings, program)]  # fmt: skip
    began, launched_unix = time.monotonic(), time.time()
    with open(folder / f"{phase}.log", "w") as log:
        code = subprocess.run(
            command, stdout=log, stderr=subprocess.STDOUT, env=environ, check=False
        ).returncode
    seconds = time.monotonic() - began
    if args.launcher == "torchrun":
        found = sorted((folder / "runs").glob(f"*/{run_id}"))
        code = stop_code(code, read_status(found[0]) if found else None, launched_unix, stop_at)
    return code, seconds


def _ran(code: int, phase: str, folder: Path, expected: tuple[int, ...]) -> None:
    if code in expected:
        return
    tail = (folder / f"{phase}.log").read_text(errors="replace").splitlines()[-15:]
    sys.stderr.write("".join(f"  {line}\n" for line in tail))
    raise HpcDdpError(
        f"the {phase} run exited with code {code} (its last lines are above; all of it in "
        f"{folder / (phase + '.log')})",
        "make the script run under that launcher first (hpc-ddp local, or torchrun), then "
        "check its resume",
    )


def check_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without what a surrounding launch set (a Slurm job's ids, a torchrun
    rank's place): the check's runs are its own, on this machine's loopback."""
    kept = {
        key: value
        for key, value in environ.items()
        if not key.startswith(LAUNCH_PREFIXES) and key not in LAUNCH_NAMES
    }
    kept.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return kept


#: Variables of a surrounding launch that the check's runs must not inherit.
LAUNCH_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "TORCHELASTIC_", "PET_")
LAUNCH_NAMES = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
     "MASTER_ADDR", "MASTER_PORT", "SLURMD_NODENAME"}
)  # fmt: skip


def _run_dir(output: Path, run_id: str) -> Path:
    found = sorted(output.glob(f"*/{run_id}"))
    if not found:
        raise HpcDdpError(
            f"the {run_id} run left no run directory under {output}",
            "the script must call hpc_ddp.start() and register what it trains",
        )
    return found[0]


def add_arguments(parser: argparse.ArgumentParser, whole_number: Any) -> None:
    """check-resume's options (``whole_number(minimum)``: app.py's argparse type)."""
    parser.add_argument(
        "--launcher",
        choices=("local", "torchrun"),
        default="local",
        help="how each run starts its ranks: as `hpc-ddp local` does (default), or with "
        "torchrun --standalone (the launcher the torchrun job template runs on each node)",
    )
    parser.add_argument(
        "--nproc", type=whole_number(1), default=2, help="number of ranks (default 2)"
    )
    parser.add_argument(
        "--steps", type=whole_number(2), default=200, help="steps each run trains (default 200)"
    )
    parser.add_argument(
        "--stop-at", type=whole_number(1), default=None, help="the step to stop at (default: half)"
    )
    parser.add_argument(
        "--output-dir",
        default=None,
        help="keep the runs in this new folder (default: a temporary one, kept only when they "
        "differ)",
    )
    parser.add_argument(
        "--world-size-change",
        type=whole_number(1),
        default=None,
        metavar="N",
        help="resume on N ranks instead of --nproc, compared within --rtol/--atol instead of "
        "bitwise (the sums over ranks change order); each rank's own state (its random "
        "streams, seeded anew) is not compared",
    )
    parser.add_argument(
        "--rtol",
        type=float,
        default=None,
        help=f"with --world-size-change: relative tolerance (default {RTOL:g})",
    )
    parser.add_argument(
        "--atol",
        type=float,
        default=None,
        help=f"with --world-size-change: absolute tolerance (default {ATOL:g})",
    )
    parser.add_argument("--set", dest="settings", action="append", default=[],
                        metavar="KEY=VALUE", help="a dotted setting for the ranks")  # fmt: skip


def _check_folder(output_dir: str | None) -> Path:
    """The check's own folder: a new temporary one, or ``output_dir`` without earlier runs
    (a run found there would be resumed instead of started)."""
    if output_dir is None:
        return Path(tempfile.mkdtemp(prefix="hpc-ddp-check-resume-"))
    folder = Path(output_dir).resolve()
    if (folder / "runs").exists():
        raise HpcDdpError(
            f"--output-dir {folder} holds the runs of an earlier check, which would be resumed",
            "pass a new folder, or remove that one",
        )
    return folder_made(folder, "--output-dir", "pass a folder you can write")


def _check_tolerance(args: argparse.Namespace) -> None:
    given = {f"--{name}": value for name, value in (("rtol", args.rtol), ("atol", args.atol))
             if value is not None}  # fmt: skip
    if given and args.world_size_change is None:
        named = " and ".join(f"{option} {value}" for option, value in given.items())
        raise HpcDdpError(
            f"{named} without --world-size-change: a resume on the same ranks is compared bitwise",
            "add --world-size-change N, or leave the tolerance out",
        )
    for option, value in given.items():
        if not value >= 0:  # negative, or NaN
            raise HpcDdpError(
                f"{option} {value} is not a tolerance", "give a number >= 0, e.g. 1e-4"
            )


#: What every run of the check is given after the user's settings (which they win over): on
#: CPU (the same kernels in every run), interval metrics at every step where the script sets
#: no cadence (the logged steps then do not depend on the machine's pace), and never a
#: requeue (the rehearsed stop is the warning signal's, which would requeue a surrounding
#: Slurm job).
CHECK_SETTINGS = ("tracking.enabled=false", "checkpoint.enabled=true", "run.log_interval=1",
                  "dist.device=cpu", "preempt.requeue=false")  # fmt: skip


def check_resume(args: argparse.Namespace) -> int:
    program = program_arguments(args, default_config=DEFAULT_CONFIG)
    program.check()  # a missing script or module is named before any run
    check_settings(args.settings, program, os.environ, after=CHECK_SETTINGS)
    if args.target is None and args.config is None:
        print(
            f"check-resume: no script named: checking the built-in trainer ({DEFAULT_CONFIG}); "
            "name yours to check it: hpc-ddp check-resume train.py [its arguments]",
            file=sys.stderr,
        )
    if args.stop_at is not None and args.stop_at >= args.steps:
        raise HpcDdpError(
            f"--stop-at {args.stop_at} is not before the end of the check (--steps {args.steps})",
            f"stop at a step below --steps, e.g. --stop-at {args.steps // 2}",
        )
    _check_tolerance(args)
    if args.world_size_change == args.nproc:
        raise HpcDdpError(
            f"--world-size-change {args.world_size_change} is the --nproc the check starts on",
            "resume on another number of ranks, or leave the option out for a bitwise check",
        )
    folder = _check_folder(args.output_dir)
    try:
        exact = _compare_runs(args, program, folder)
    except BaseException:
        print(f"check-resume: its runs and their logs are kept in {folder}", file=sys.stderr)
        raise
    if exact and args.output_dir is None:
        shutil.rmtree(folder, ignore_errors=True)
    return 0 if exact else EXIT_DIFFERS


def _compare_runs(args: argparse.Namespace, program: Program, folder: Path) -> bool:
    """The three runs in ``folder`` and their comparison, printed; whether it was exact."""
    from hpc_ddp.view.resume_check import (
        Tolerance,
        differences,
        logged_after,
        metric_differences,
        saved_state,
    )
    from hpc_ddp.view.resume_verdict import resume_warnings, verdict

    output = folder / "runs"
    common = [f"run.output_dir={output}", *CHECK_SETTINGS]
    steps = args.steps
    ended = (0, EXIT_STOPPED)
    code, straight_s = _launch(args, program, folder, common, "straight", steps, "straight")
    _ran(code, "straight", folder, ended)
    straight_step, straight = saved_state(_run_dir(output, "straight"))
    if straight_step == 0:
        raise HpcDdpError(
            "the script trained without counting a step: no stop can land in it",
            "loop with run.steps(...), run.iterations(...) or run.epochs(...): they count "
            "the steps, stop between them and resume the position",
        )
    stop = args.stop_at or max(1, straight_step // 2)
    if stop >= straight_step:
        raise HpcDdpError(
            f"the script trained {straight_step} step(s) without a stop: none is left to stop at "
            f"step {stop}",
            "give a --stop-at below that, or let the script train more steps",
        )
    code, stopped_s = _launch(args, program, folder, common, "resumed", stop, "stopped")
    _ran(code, "stopped", folder, (EXIT_STOPPED,))
    resumed_on = args.world_size_change or args.nproc
    code, resumed_s = _launch(
        args, program, folder, common, "resumed", steps, "resumed", resumed_on
    )
    _ran(code, "resumed", folder, ended)
    resumed_dir = _run_dir(output, "resumed")
    resumed_step, resumed = saved_state(resumed_dir)
    tolerance, across = None, ""
    if args.world_size_change:
        tolerance = Tolerance(
            RTOL if args.rtol is None else args.rtol, ATOL if args.atol is None else args.atol
        )
        across = f"resumed on {resumed_on} rank(s) instead of {args.nproc}, within {tolerance}"
    found = differences(straight, resumed, tolerance)
    logged = metric_differences(
        logged_after(_run_dir(output, "straight"), stop), logged_after(resumed_dir, stop),
        tolerance,
    )  # fmt: skip
    logs = [(folder / f"{phase}.log").read_text(errors="replace") for phase in PHASES]
    warned = resume_warnings(logs)
    answer = verdict(found, logged, resumed_step, stop, across, warned)
    print(f"check-resume: {answer.what}")
    for warning in warned:  # each one the answer does not give already
        if warning.partition(" HINT: ")[0].rstrip(".") not in answer.what:
            print(f"  the runs also warned: {warning}")
    if not answer.exact:
        for difference in found[:8]:
            print(f"  {difference.key}: {difference.straight} never stopped, "
                  f"{difference.resumed} resumed")  # fmt: skip
        print(f"  HINT: {answer.hint}")
        print(f"  the runs and their logs are kept in {folder}")
    cost = straight_s + stopped_s + resumed_s
    ranks = f"{args.nproc}" if resumed_on == args.nproc else f"{args.nproc} and {resumed_on}"
    print(f"  (3 runs on {ranks} {args.launcher} ranks took {cost:.0f} s)")
    return answer.exact
