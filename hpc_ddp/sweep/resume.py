"""Resubmitting the tasks of a sweep that did not finish (failed, lost, never started), with
changed settings if asked, once none of its tasks is queued or running."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.sweep import arrays, manifest
from hpc_ddp.sweep.calls import CallableProgram, check_calls
from hpc_ddp.sweep.programs import check_settings, recorded_program, refuse_conflicts
from hpc_ddp.sweep.spec import Settings, check_key, command_line_key, value_text, with_overrides
from hpc_ddp.sweep.submit import Say, ranges, submit_tasks


def live_jobs(data: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, str]:
    """Slurm's state of the sweep's queued and running array tasks; HpcDdpError when
    squeue cannot be asked."""
    live = arrays.live_tasks([array["job_id"] for array in data["arrays"]], environ)
    if live is None:
        raise HpcDdpError(
            "cannot ask Slurm which of the sweep's tasks still run (squeue failed)",
            "run this on a host where squeue answers (a login node)",
        )
    return live


def resume_sweep(
    sweep_dir: Path,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] = os.environ,
    say: Say = print,
    trainer_settings: Collection[str] = (),
) -> list[int]:
    """Resubmit the tasks that did not finish (failed, lost, never started) as new arrays,
    each in its own run directory again, with ``overrides`` (``KEY=VALUE``) applied to
    them; refused while any task of the sweep is queued or running. Returns the tasks.
    ``trainer_settings``: the built-in trainer's dotted keys, for a sweep of it."""
    pairs = [_override(text) for text in overrides]  # bad words refused before asking Slurm
    data = manifest.read_manifest(sweep_dir)  # as given: a refusal names what was meant
    # The job scripts name the sweep's folder: absolutely, wherever the jobs work.
    sweep_dir = sweep_dir.resolve()
    live = live_jobs(data, environ)
    running = [
        task
        for task in data["tasks"]
        if task.get("job") in live and task["state"] not in manifest.ENDED
    ]
    if running:
        named = ", ".join(
            f"{task['index']} ({task['job']} {live[task['job']]})" for task in running
        )
        raise HpcDdpError(
            f"sweep {data['name']} is still running: tasks {named}",
            "wait for them to end (hpc-ddp sweep status shows them), or scancel them first",
        )
    chosen = [task["index"] for task in data["tasks"] if task["state"] != "finished"]
    if not chosen:
        say(f"every task of sweep {data['name']} finished: nothing to resume")
        return []
    if pairs:  # a callable is loaded (its module imported) only to check changed arguments
        program = recorded_program(sweep_dir, data)
        check_settings([key for key, _ in pairs], program, trainer_settings)
        refuse_conflicts(program, {key for key, _ in pairs})
        if isinstance(program, CallableProgram):
            changed = [with_overrides(data["tasks"][index]["settings"], pairs) for index in chosen]
            check_calls(program, changed, overriding=True)

    def reset(task: dict[str, Any]) -> None:
        settings: Settings = with_overrides(task["settings"], pairs)
        task.update(state="pending", settings=settings, error=None, job=None)
        task["since_array"] = len(data["arrays"])  # its job: an array submitted from now on
        if pairs:
            task["overrides"] = [*task.get("overrides", ()), *(f"{k}={v}" for k, v in pairs)]

    manifest.update_tasks(sweep_dir, [data["tasks"][index] for index in chosen], reset)
    tracking = data.get("tracking") or {}
    if tracking.get("parent_run_id"):
        from hpc_ddp.sweep.parent import set_parent_status

        set_parent_status(tracking["uri"], tracking["parent_run_id"], "RUNNING")
    say(f"resubmitting {len(chosen)} of {len(data['tasks'])} tasks: {ranges(chosen)}")
    submit_tasks(sweep_dir, chosen, arrays.read_max_array_size(environ), environ, say)
    return chosen


def _override(text: str) -> tuple[str, str]:
    key, equals, value = text.partition("=")
    key = command_line_key(key)
    if not equals:
        raise HpcDdpError(
            f"--set {text!r} is not KEY=VALUE",
            "e.g. --set lr=0.05 (your --lr) or --set train.epochs=3",
        )
    check_key(key, "--set")
    return key, value_text(value, f"--set {key}")
