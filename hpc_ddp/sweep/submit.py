"""Submitting a sweep as job arrays (and a resume's tasks: :mod:`hpc_ddp.sweep.resume`).

Nothing stays alive on the login node: the sweep's state lives in its record (sweep.json and
the files beside it), in its tasks' run directories and in Slurm's queue.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.launch.importable import check_importable
from hpc_ddp.launch.program import Program
from hpc_ddp.launch.sbatch import RenderRequest
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.safefiles import make_dirs, replace_bytes
from hpc_ddp.runtime.tracking.base import artifact_root, tracking_uri
from hpc_ddp.sweep import arrays, manifest
from hpc_ddp.sweep.calls import CallableProgram, check_calls, pickled, write_program
from hpc_ddp.sweep.programs import (
    check_settings,
    refuse_conflicts,
    runtime_settings,
)
from hpc_ddp.sweep.spec import (
    SweepSpec,
    expand,
)

Say = Callable[[str], None]
#: Copies the program's code into a folder and returns the program started from the copy.
Snapshot = Callable[[Program, Path], Program]


def _sweep_dir(output_dir: Path, name: str) -> Path:
    sweep_dir = output_dir / name
    if manifest.manifest_path(sweep_dir).exists():
        other = manifest.read_manifest(sweep_dir)
        raise HpcDdpError(
            f"{sweep_dir} already holds sweep {other.get('name')!r} ({len(other['tasks'])} tasks)",
            f"continue it with `hpc-ddp sweep resume {sweep_dir}`, or give this sweep another name",
        )
    if sweep_dir.exists() and any(sweep_dir.iterdir()):
        raise HpcDdpError(
            f"{sweep_dir} holds runs that are not a sweep's (no {manifest.MANIFEST_FILE})",
            "give the sweep another name, or set --output-dir to another folder",
        )
    return sweep_dir


def submit_sweep(
    spec: SweepSpec,
    program: Program | CallableProgram,
    job: RenderRequest,
    output_dir: Path,
    environ: Mapping[str, str] = os.environ,
    say: Say = print,
    snapshot: Snapshot | None = None,
    trainer_settings: Collection[str] = (),
) -> Path:
    """Check everything, record the sweep, make its MLflow parent run and submit its
    arrays; returns the sweep's folder. ``snapshot``, once every check passed, copies a
    script's code into ``<sweep dir>/snapshots``: every task runs that copy.
    ``trainer_settings``: the built-in trainer's dotted keys, for a sweep of it."""
    program.check()
    tasks = expand(spec)
    swept = {key for task in tasks for key in task}
    check_settings(sorted(swept), program, trainer_settings)
    refuse_conflicts(program, swept)
    code = None
    if isinstance(program, CallableProgram):
        check_calls(program, tasks)
        code = pickled(program)
        check_importable(program.function, "every task", Path.cwd(), environ)
    settings = runtime_settings(program, environ)
    output_dir = output_dir.resolve()
    sweep_dir = _sweep_dir(output_dir, spec.name)
    # Refused here, not once the record is written (a sweep there could not be resubmitted).
    try:
        _array_script(job_from(_job_fields(job)), spec.name, sweep_dir, 0)
    except HpcDdpError as refused:
        if "log folder" not in refused.message:
            raise
        raise HpcDdpError(
            f"the sweep's folder {sweep_dir} cannot be named in an #SBATCH line (its jobs' "
            f"logs go there): {refused.message}",
            "give --output-dir a path of letters, digits and . _ - / only",
        ) from None
    if snapshot is not None and isinstance(program, Program):
        program = snapshot(program, sweep_dir / "snapshots")
    max_size = arrays.read_max_array_size(environ)
    tracking = None
    if settings.tracking.enabled:
        tracking = {
            "uri": tracking_uri(settings.tracking, output_dir),
            "experiment": settings.tracking.experiment,
            "parent_run_id": None,
        }
    record = {
        "name": spec.name,
        "program": {"kind": program.kind, "name": program.name, "args": list(program.args)},
        "job": _job_fields(job),
        "workdir": str(Path.cwd()),
        "output_dir": str(output_dir),
        "concurrency": spec.concurrency,
        "metric": spec.metric,
        "mode": spec.mode,
        "tracking": tracking,
        "arrays": [],
        "tasks": [
            manifest.new_task(index, task, manifest.run_id_for(index, len(tasks)))
            for index, task in enumerate(tasks)
        ],
    }
    manifest.create_manifest(sweep_dir, record)
    if code is not None:
        write_program(sweep_dir, code)
    if tracking is not None:
        _make_parent(sweep_dir, tracking, spec, len(tasks), output_dir, say)
    submit_tasks(sweep_dir, list(range(len(tasks))), max_size, environ, say)
    return sweep_dir


def _job_fields(job: RenderRequest) -> dict[str, Any]:
    """What the record keeps of the job (its arguments are each array's own)."""
    return {k: v for k, v in dataclasses.asdict(job).items() if k != "arguments"}


def job_from(fields: Mapping[str, Any]) -> RenderRequest:
    """The job the record keeps (JSON's lists back to the request's pairs; a record written
    before sbatch options were kept has none)."""
    options = tuple((name, value) for name, value in fields.get("sbatch_options", ()))
    return RenderRequest(arguments=(), **{**fields, "sbatch_options": options})


def _make_parent(
    sweep_dir: Path,
    tracking: Mapping[str, Any],
    spec: SweepSpec,
    count: int,
    output_dir: Path,
    say: Say,
) -> None:
    from hpc_ddp.sweep.parent import create_parent_run

    params = {"sweep.name": spec.name, "sweep.tasks": str(count)}
    params["sweep.concurrency"] = str(spec.concurrency or "")
    try:
        run_id = create_parent_run(
            tracking["uri"], tracking["experiment"], artifact_root(output_dir), spec.name, params
        )
    except Exception as error:  # MLflow down: the sweep runs, its tasks tracked on their own
        say(f"warning: no MLflow parent run for the sweep ({error}); its tasks are tracked alone")
        return

    def note(record: dict[str, Any]) -> None:
        record["tracking"]["parent_run_id"] = run_id

    manifest.update_definition(sweep_dir, note)


def submit_tasks(
    sweep_dir: Path, tasks: list[int], max_size: int, environ: Mapping[str, str], say: Say
) -> list[str]:
    """Render and sbatch the arrays that run ``tasks``, each after the one before, so the
    sweep's concurrency holds across them."""
    data = manifest.read_manifest(sweep_dir)
    job = job_from(data["job"])
    split = arrays.split_into_arrays(tasks, max_size)
    if len(split) > 1:
        say(
            f"{len(tasks)} tasks do not fit one job array (the cluster's MaxArraySize is "
            f"{max_size}): submitting {len(split)} arrays, each starting after the one before"
        )
    scripts = sweep_dir / "jobs"
    make_dirs(scripts)
    make_dirs(sweep_dir / "logs")
    submitted: list[str] = []
    queued: list[int] = []
    previous = None
    for array in split:
        text = _array_script(job, data["name"], sweep_dir, array.offset)
        script = scripts / f"array-{len(data['arrays']) + len(submitted)}.sh"
        replace_bytes(script, text.encode())
        try:
            job_id = arrays.submit_array(
                script, array, data["concurrency"], previous, Path(data["workdir"]), environ
            )
        except HpcDdpError as refused:
            raise _partly_submitted(refused, sweep_dir, tasks, submitted, queued) from None
        queued += array.tasks
        submitted.append(job_id)
        previous = job_id
        _record_array(sweep_dir, job_id, array, script)
        spec = arrays.array_spec(array.indices, data["concurrency"])
        say(f"submitted job array {job_id} (--array={spec}): tasks {ranges(array.tasks)}")
    return submitted


def _partly_submitted(
    refused: HpcDdpError,
    sweep_dir: Path,
    tasks: Sequence[int],
    submitted: Sequence[str],
    queued: Sequence[int],
) -> HpcDdpError:
    """sbatch refused an array after others were queued: which tasks are queued, which not,
    and how to submit the rest."""
    if not submitted:
        return refused
    left = sorted(set(tasks) - set(queued))
    return HpcDdpError(
        f"{refused.message}; tasks {ranges(queued)} are queued (job arrays "
        f"{', '.join(submitted)}), tasks {ranges(left)} are not",
        f"{refused.hint}; then, once the queued tasks ended (or after scancel "
        f"{' '.join(submitted)}), `hpc-ddp sweep resume {sweep_dir}` submits every task that "
        "did not finish",
    )


def _array_script(job: RenderRequest, name: str, sweep_dir: Path, offset: int) -> str:
    """The job script of the array whose first task is ``offset`` (rendered with every
    check of `hpc-ddp render`)."""
    request = dataclasses.replace(
        job,
        job_name=name,
        log_dir=str(sweep_dir / "logs"),
        arguments=("-m", "hpc_ddp.sweep.task", str(sweep_dir), "--offset", str(offset)),
    )
    return arrays.job_script(request, sweep_dir, offset)


def _record_array(sweep_dir: Path, job_id: str, array: arrays.Array, script: Path) -> None:
    manifest.record_array(sweep_dir, job_id, array.offset, list(array.tasks), str(script))


def ranges(tasks: Sequence[int]) -> str:
    """Tasks as a short text: 0-3, 7."""
    return arrays.array_spec(tasks, None).replace(",", ", ")
