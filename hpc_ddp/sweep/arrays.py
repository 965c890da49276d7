"""A sweep's tasks as Slurm job arrays: the cluster's MaxArraySize, the arrays a set of
tasks needs, the job script each runs, their submission and what Slurm says of them now.

The parsing and the arithmetic are pure functions; :func:`submit_arrays` and
:func:`live_tasks` call ``sbatch`` and ``squeue``.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.launch.sbatch import RenderRequest, render_sbatch, template_path
from hpc_ddp.runtime.errors import HpcDdpError

#: Slurm's default MaxArraySize (used when `scontrol show config` cannot be read).
DEFAULT_MAX_ARRAY_SIZE = 1001
_SRUN = 'srun --kill-on-bad-exit=1 --label "${blocked_until_held[@]}" "$python" "${program[@]}"'
_SRUN_LINE = _SRUN + " || status=$?\n"


@dataclass(frozen=True)
class Array:
    """One job array: task ``offset + i`` for each array index ``i``."""

    offset: int
    indices: tuple[int, ...]

    @property
    def tasks(self) -> tuple[int, ...]:
        return tuple(self.offset + index for index in self.indices)


def max_array_size(config_text: str) -> int:
    """MaxArraySize from `scontrol show config` (Slurm's default when the line is absent)."""
    match = re.search(r"^MaxArraySize\s*=\s*(\d+)", config_text, re.MULTILINE)
    size = int(match.group(1)) if match else DEFAULT_MAX_ARRAY_SIZE
    if size < 1:
        raise HpcDdpError(
            f"this cluster's Slurm takes no job arrays (MaxArraySize={size}), and a sweep's "
            "tasks run as job arrays",
            "ask the cluster's admins whether arrays can be enabled, or submit each setting "
            "as a job of its own (hpc-ddp render --set ..., then sbatch)",
        )
    return size


def read_max_array_size(environ: Mapping[str, str]) -> int:
    """The cluster's MaxArraySize, asked of `scontrol show config`."""
    try:
        result = subprocess.run(
            ["scontrol", "show", "config"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            env=dict(environ),
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise HpcDdpError(
            f"cannot ask Slurm for its limits (scontrol show config: {error})",
            "submit a sweep from a host with Slurm's commands (a login node)",
        ) from None
    if result.returncode != 0:
        raise HpcDdpError(
            f"scontrol show config failed: {result.stderr.strip()[:300]}",
            "submit a sweep from a host where Slurm answers (a login node)",
        )
    return max_array_size(result.stdout)


def split_into_arrays(tasks: Sequence[int], max_size: int) -> list[Array]:
    """The arrays that run ``tasks``: Slurm takes array indices below ``max_size`` only, so
    task ``t`` goes to the array with offset ``(t // max_size) * max_size``."""
    arrays: dict[int, list[int]] = {}
    for task in sorted(set(tasks)):
        offset = (task // max_size) * max_size
        arrays.setdefault(offset, []).append(task - offset)
    return [Array(offset, tuple(indices)) for offset, indices in sorted(arrays.items())]


def array_spec(indices: Sequence[int], concurrency: int | None) -> str:
    """``--array``'s value: ranges of the indices, then ``%K``: ``0-4,7%2``."""
    parts: list[str] = []
    run: list[int] = []
    for index in sorted(indices):
        if run and index == run[-1] + 1:
            run.append(index)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [index]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts) + (f"%{concurrency}" if concurrency else "")


def job_script(request: RenderRequest, sweep_dir: Path, offset: int) -> str:
    """The job script of one array: slurm/train.sh's, each array task running sweep task
    ``offset + SLURM_ARRAY_TASK_ID`` and recording how it ended."""
    text = render_sbatch(template_path().read_text(), request)
    if text.count(_SRUN_LINE) != 1:
        raise HpcDdpError("the train.sh template has no single srun line", "reinstall hpc_ddp")
    text = re.sub(r"^(#SBATCH --(?:output|error)=.*)%j", r"\g<1>%A_%a", text, flags=re.M)
    task = ["-m", "hpc_ddp.sweep.task", str(sweep_dir), "--offset", str(offset)]
    quoted = " ".join(shlex.quote(word) for word in task)
    ending = f"""program=({quoted})
# The task's end goes into the sweep's record (a preemption's requeue ends this script before
# it); when the attempt began tells its run's record from an earlier attempt's. A rank lost
# to its host leaves the host out of this task's job, which is requeued (as in slurm/train.sh):
# the task has not ended then.
set +e
began=$(date +%s.%N)
{_SRUN}
status=$?
set -e
if ((status != 0)); then
    trap '' TERM  # the requeue's SIGTERM must not stop the answer
    answered=0
    "$python" -m hpc_ddp.launch.step_failure "$status" "$log_from" || answered=$?
    if ((answered == 0)); then
        exit 0
    fi
    status=$answered
fi
"$python" {quoted} --ended "$status" --began "$began"
exit "$status"
"""
    return text.replace(_SRUN_LINE, ending)


def submit_array(
    script: Path,
    array: Array,
    concurrency: int | None,
    after: str | None,
    workdir: Path,
    environ: Mapping[str, str],
) -> str:
    """sbatch one array (after the job ``after`` ended, if given); returns its job id."""
    command = ["sbatch", "--parsable", f"--array={array_spec(array.indices, concurrency)}"]
    if after:
        command.append(f"--dependency=afterany:{after}")
    command += [f"--chdir={workdir}", str(script)]
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=60, check=False, env=dict(environ)
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise HpcDdpError(f"sbatch failed: {error}", "submit from a login node") from None
    if result.returncode != 0:
        raise HpcDdpError(
            f"sbatch refused the array ({shlex.join(command)}): {result.stderr.strip()[:400]}",
            "check the job options (--partition, --time, --nodes) against the cluster's limits",
        )
    return result.stdout.strip().split(";")[0]


def live_tasks(array_jobs: Sequence[str], environ: Mapping[str, str]) -> dict[str, str] | None:
    """Slurm's state of every array task still queued or running, by ``<array>_<index>``
    (None when squeue cannot be asked)."""
    if not array_jobs:
        return {}
    try:
        result = subprocess.run(
            ["squeue", "-h", "-r", "-j", ",".join(array_jobs), "-o", "%i %T"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            env=dict(environ),
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        # squeue refuses ids it no longer knows when every one of them has ended.
        return {} if "Invalid job id" in result.stderr else None
    states = {}
    for line in result.stdout.splitlines():
        job, _, state = line.strip().partition(" ")
        if job and state:
            states[job] = state
    return states
