"""What an array task of a sweep runs: ``python -m hpc_ddp.sweep.task SWEEP_DIR --offset O``.

On every rank (srun starts it): sweep task ``O + SLURM_ARRAY_TASK_ID``'s program, with its
settings, in its own run directory (``run.id=task-N``), in this process as ``hpc-ddp run``
runs it (stop signals held from the first line); the first rank records the attempt first.
With ``--ended CODE`` (the job script, once srun
returned): how the attempt ended, from the run's own record, into the sweep's record; the
sweep's MLflow parent run ends with its last task.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_ddp.launch.program import Program, run_program
from hpc_ddp.runtime.config import OVERRIDES_VARIABLE, environment_overrides
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.place.slurm import queue_job_id
from hpc_ddp.runtime.preempt.startup_signals import hold_stop_signals
from hpc_ddp.runtime.tracking.membership import SweepMembership, write_membership
from hpc_ddp.runtime.tracking.record import read_tracked_run_id
from hpc_ddp.runtime.tracking.worker import discard_prestarted, prestart
from hpc_ddp.sweep import manifest
from hpc_ddp.sweep.spec import describe, program_words, setting_words
from hpc_ddp.sweep.taskstate import recount

if TYPE_CHECKING:
    from hpc_ddp.view.runs import RunView


def task_index(offset: int, environ: Mapping[str, str]) -> int:
    array_index = environ.get("SLURM_ARRAY_TASK_ID", "")
    if not array_index.isdigit():
        raise HpcDdpError(
            "hpc_ddp.sweep.task runs as a task of a sweep's job array (no SLURM_ARRAY_TASK_ID)",
            "submit the sweep with `hpc-ddp sweep submit`; to run one task by hand, start its "
            "program with the settings `hpc-ddp sweep status` shows",
        )
    return offset + int(array_index)


def task_program(data: Mapping[str, Any], task: Mapping[str, Any]) -> Program:
    """The sweep's program with the task's own options after its fixed arguments."""
    program = data["program"]
    words = (*program["args"], *program_words(task["settings"]))
    return Program(program["kind"], program["name"], words)


def task_environ(
    data: Mapping[str, Any], task: Mapping[str, Any], environ: Mapping[str, str]
) -> dict[str, str]:
    """The ranks' environment: the task's dotted settings and its run directory in
    $HPC_DDP_OVERRIDES (after those already there), the sweep's MLflow store. An exported
    MLFLOW_RUN_ID is left out: MLflow would log every task into that one run."""
    words = [
        *environment_overrides(environ),
        *setting_words(task["settings"]),
        f"run.output_dir={data['output_dir']}",
        f"run.name={data['name']}",
        f"run.id={task['run_id']}",
    ]
    tracking = data.get("tracking")
    if tracking:
        words += [
            f"tracking.uri={tracking['uri']}",
            f"tracking.experiment={tracking['experiment']}",
        ]
    changed = {key: value for key, value in environ.items() if key != "MLFLOW_RUN_ID"}
    changed[OVERRIDES_VARIABLE] = " ".join(shlex.quote(word) for word in words)
    return changed


def start_task(sweep_dir: Path, offset: int, environ: MutableMapping[str, str]) -> int:
    """Run the task's program on this rank, with its settings exported into ``environ``;
    returns its exit code (the built-in trainer replaces this process)."""
    data, task = manifest.read_task(sweep_dir, task_index(offset, environ))
    index = task["index"]
    is_main = environ.get("SLURM_PROCID", "0") == "0"
    if is_main:
        tracking = data.get("tracking") or {}
        membership = SweepMembership(
            data["name"],
            index,
            dict(task["settings"]),
            tracking.get("parent_run_id"),
            tuple(task.get("overrides", ())),
        )
        write_membership(manifest.run_dir_of(data, task), membership)
        if data["program"]["kind"] == "callable":
            from hpc_ddp.sweep.calls import forget_result

            forget_result(manifest.run_dir_of(data, task))
        job = queue_job_id(environ)

        def started(entry: dict[str, Any]) -> None:
            entry.update(state="running", attempts=int(entry["attempts"]) + 1, job=job, error=None)

        manifest.update_tasks(sweep_dir, [task], started)
        # The job's log names the task's settings: its job script only names the sweep.
        print(
            f"sweep {data['name']} task {index} (job {job}): {describe(task['settings'])}",
            flush=True,
        )
    changed = task_environ(data, task, environ)
    environ.pop("MLFLOW_RUN_ID", None)
    environ.update(changed)
    if data["program"]["kind"] == "callable":
        from hpc_ddp.sweep.calls import call_task

        prestart(environ, ())
        try:
            run_dir = manifest.run_dir_of(data, task)
            return call_task(sweep_dir, task["settings"], run_dir, is_main)
        finally:
            discard_prestarted()  # a tracking process the callable's run never took
    program = task_program(data, task)
    if program.kind == "builtin":
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, *program.python_args()])
    prestart(environ, program.args)  # as `hpc-ddp run` does: mlflow's import overlaps torch's
    return run_program(program)


def ended_state(code: int, run_state: str | None) -> str:
    """The task's state after an attempt that exited with ``code``, its run's record
    saying ``run_state`` (None: the run never started)."""
    if code == 0 and run_state in ("finished", None):  # None: a program that is no run
        return "finished"
    if run_state in ("requeued", "stopped"):
        return run_state
    return "failed"


def attempt_run_state(run: RunView | None, began: float | None) -> str | None:
    """The run's state as this attempt left it (``began``: when the attempt's job script
    started srun). None where the run's record is older: this attempt ended before its run
    started (a rank that died at once), and the record's state, say "requeued", is an
    earlier attempt's."""
    if run is None or (began is not None and run.updated < began):
        return None
    return run.state


def record_end(
    sweep_dir: Path, offset: int, code: int, environ: Mapping[str, str], began: float | None
) -> None:
    """Put how this attempt ended into the sweep's record; end the parent run with the
    sweep's last task."""
    from hpc_ddp.view.runs import load_run

    data, task = manifest.read_task(sweep_dir, task_index(offset, environ))
    run_dir = manifest.run_dir_of(data, task)
    try:
        run = load_run(run_dir)
    except HpcDdpError:
        run = None
    state = ended_state(code, attempt_run_state(run, began))
    log = f"{data['name']}-{queue_job_id(environ)}"  # the array's %x-%A_%a
    error = None if state != "failed" else f"exit code {code}: see {sweep_dir}/logs/{log}.out"

    def ended(entry: dict[str, Any]) -> None:
        entry.update(
            state=state,
            error=error,
            final={**run.train, **run.val} if run else {},
            step=run.global_step if run else 0,
            mlflow_run_id=read_tracked_run_id(run_dir),
        )

    ended_tasks = manifest.update_tasks(sweep_dir, [task], ended)
    tracking = data.get("tracking") or {}
    total = len(data["tasks"])
    if tracking.get("parent_run_id") and ended_tasks >= total and recount(sweep_dir) >= total:
        _end_parent(manifest.read_manifest(sweep_dir))  # only the sweep's last end reads all


def _end_parent(record: Mapping[str, Any]) -> None:
    tracking = record.get("tracking") or {}
    states = [task["state"] for task in record["tasks"]]
    if not tracking.get("parent_run_id") or any(s not in manifest.ENDED for s in states):
        return
    from hpc_ddp.sweep.parent import set_parent_status

    status = "FINISHED" if all(state == "finished" for state in states) else "FAILED"
    set_parent_status(tracking["uri"], tracking["parent_run_id"], status)


def _seconds(text: str) -> float | None:
    """A Unix time; None for what a `date` without %N printed (the attempt's start is then
    unknown, and the run's record is taken as this attempt's)."""
    try:
        return float(text)
    except ValueError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.sweep.task")
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--ended", type=int, default=None, metavar="CODE")
    parser.add_argument("--began", type=_seconds, default=None, metavar="UNIX_TIME")
    args = parser.parse_args(argv)
    try:
        if args.ended is None:
            return start_task(args.sweep_dir, args.offset, os.environ)
        record_end(args.sweep_dir, args.offset, args.ended, os.environ, args.began)
    except HpcDdpError as error:
        print(f"hpc_ddp.sweep.task: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    hold_stop_signals()  # a stop signal during the imports is handled once the run starts
    sys.exit(main())
