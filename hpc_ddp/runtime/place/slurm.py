"""Slurm's notations (host lists, tasks-per-node), the rendezvous port, and job queries.

Nothing here reads the environment; every function takes its inputs as arguments. Only
:func:`ask_slurm` talks to Slurm (``scontrol``, ``squeue``), and the caller decides when.
"""

from __future__ import annotations

import itertools
import math
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hpc_ddp.runtime.errors import HpcDdpError

#: Ports derived from the job id lie in [PORT_BASE, PORT_BASE + PORT_SPAN). The range stays
#: below Linux's default ephemeral range (32768-60999), so an outgoing connection on the
#: master node can never already hold the port we derive.
PORT_BASE = 10000
PORT_SPAN = 20000
#: Concurrent job steps of one job get neighbouring ports (step id modulo this), so two
#: `srun` launched side by side in one allocation do not clash either.
PORT_STEP_SLOTS = 10

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
#: Slurm's time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?")
_TASKS_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise HpcDdpError(
                    f"unbalanced ']' in Slurm host list {quoted(text)}",
                    "host lists look like 'gpu[001-004,010]' or 'a,b[1-3],c'",
                )
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise HpcDdpError(
            f"unbalanced '[' in Slurm host list {quoted(text)}",
            "host lists look like 'gpu[001-004,010]' or 'a,b[1-3],c'",
        )
    parts.append("".join(current))
    return parts


#: More hosts than any Slurm cluster has (Slurm's own limit is 65,533 nodes): a host list
#: that expands further is a mistake, refused before it is built.
MAX_HOSTS = 65_536


def quoted(text: str, limit: int = 120) -> str:
    """``text`` quoted for a message, cut to ``limit`` characters."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text):,} characters)"


def _too_many(count: int, whole: str) -> HpcDdpError:
    return HpcDdpError(
        f"Slurm host list {quoted(whole)} names {count:,} hosts, more than {MAX_HOSTS:,}",
        "check SLURM_STEP_NODELIST / SLURM_JOB_NODELIST: a range is probably mistyped",
    )


def _expand_bracket(body: str, whole: str) -> list[str]:
    """Expand the inside of one bracket, e.g. '001-004,010', keeping zero padding."""
    values: list[str] = []
    for item in body.split(","):
        match = _RANGE.match(item.strip())
        if not match:
            raise HpcDdpError(
                f"cannot read range {quoted(item, 40)} in Slurm host list {quoted(whole)}",
                "a bracket holds numbers and ranges, e.g. 'node[01-04,07]'",
            )
        low_text, high_text = match.group(1), match.group(2)
        if high_text is None:
            values.append(low_text)
            continue
        low, high = int(low_text), int(high_text)
        if high - low + 1 + len(values) > MAX_HOSTS:
            raise _too_many(high - low + 1 + len(values), whole)
        if high < low:
            raise HpcDdpError(
                f"range {quoted(item, 40)} in Slurm host list {quoted(whole)} runs backwards",
                "write ranges low-high, e.g. 'node[1-4]'",
            )
        width = len(low_text)
        values.extend(str(number).zfill(width) for number in range(low, high + 1))
    return values


def _expand_host_pattern(pattern: str, whole: str) -> list[str]:
    """Expand one comma-free pattern that may hold several bracket groups."""
    pieces: list[list[str]] = []
    position = 0
    for match in re.finditer(r"\[([^\[\]]*)\]", pattern):
        pieces.append([pattern[position : match.start()]])
        pieces.append(_expand_bracket(match.group(1), whole))
        position = match.end()
    pieces.append([pattern[position:]])
    if any("[" in piece or "]" in piece for group in pieces for piece in group):
        raise HpcDdpError(
            f"nested brackets in Slurm host list {quoted(whole)}",
            "host lists look like 'gpu[001-004,010]' or 'rack[1-2]-node[01-02]'",
        )
    count = math.prod(len(group) for group in pieces)
    if count > MAX_HOSTS:
        raise _too_many(count, whole)
    return ["".join(combination) for combination in itertools.product(*pieces)]


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm host list ('gpu[001-004,010]', 'rack[1-2]-node[01-02]', 'a,b[1-3],c').

    Hosts come back in Slurm's order; the first host is where rank 0 runs.
    """
    # Spaces separate hosts as commas do (Slurm's own hostlist reading, e.g. `scontrol show
    # hostnames "a b"`); a list written by hand often has them.
    text = re.sub(r"\s+", ",", re.sub(r"\s*,\s*", ",", hostlist.strip()))
    if not text:
        raise HpcDdpError(
            "the Slurm host list is empty", "check SLURM_STEP_NODELIST / SLURM_JOB_NODELIST"
        )
    hosts: list[str] = []
    for part in _split_top_level(text):
        part = part.strip()
        if not part:
            raise HpcDdpError(
                f"empty entry in Slurm host list {quoted(hostlist)}",
                "host lists look like 'a,b[1-3],c' with no empty items",
            )
        hosts.extend(_expand_host_pattern(part, hostlist))
        if len(hosts) > MAX_HOSTS:
            raise _too_many(len(hosts), hostlist)
    return hosts


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expand Slurm's tasks-per-node notation ('4', '2(x3)', '2(x3),1') to one count per node."""
    counts: list[int] = []
    for item in spec.strip().split(","):
        match = _TASKS_ITEM.match(item.strip())
        if not match:
            raise HpcDdpError(
                f"cannot read tasks-per-node {quoted(spec)} (at {quoted(item, 40)})",
                "Slurm writes it as '4', '2(x3)' or '2(x3),1'",
            )
        count = int(match.group(1))
        repeat = int(match.group(2)) if match.group(2) else 1
        counts.extend([count] * repeat)
    return counts


def derive_master_port(job_id: int, step_id: int = 0) -> int:
    """The rendezvous port every rank of a job step computes alike, without talking.

    ``PORT_BASE + (job_id % (PORT_SPAN // PORT_STEP_SLOTS)) * PORT_STEP_SLOTS + step_id %
    PORT_STEP_SLOTS``: range 10000-29999. Two jobs clash only if their ids are congruent
    modulo 2000 and their first nodes coincide while both run.
    """
    job_slots = PORT_SPAN // PORT_STEP_SLOTS
    return PORT_BASE + (job_id % job_slots) * PORT_STEP_SLOTS + step_id % PORT_STEP_SLOTS


@dataclass(frozen=True)
class SlurmAnswer:
    """What a Slurm client printed, and what went wrong (None when it exited 0)."""

    output: str
    failure: str | None


def queue_job_id(environ: Mapping[str, str]) -> str | None:
    """The job as squeue, sacct and ``%A_%a`` log names give it: ``<array id>_<task id>`` for
    an array's task (whose SLURM_JOB_ID is a number of its own), else SLURM_JOB_ID; None
    outside Slurm."""
    array_job, array_task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    return environ.get("SLURM_JOB_ID")


def ask_slurm(
    words: Sequence[str], timeout_s: float, environ: Mapping[str, str] | None = None
) -> SlurmAnswer:
    """Run a Slurm client (``words[0]``: scontrol, squeue) for at most ``timeout_s``, in
    ``environ`` (default: this process's); a missing client or a timeout is a failure, not
    an exception."""
    try:
        result = subprocess.run(
            list(words), capture_output=True, text=True, timeout=timeout_s, check=False,
            env=None if environ is None else dict(environ),
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as error:
        return SlurmAnswer("", str(error))
    failure = (
        None if result.returncode == 0 else result.stderr.strip() or f"exit {result.returncode}"
    )
    return SlurmAnswer(result.stdout, failure)


def squeue_job_start(job: str, environ: Mapping[str, str], timeout_s: float = 5.0) -> float | None:
    """When Slurm started ``job`` (Unix time, as squeue gives it with SLURM_TIME_FORMAT=%s;
    squeue run in ``environ``), or None when squeue does not answer or has no start."""
    words = ["squeue", "--noheader", "--jobs", job, "--format", "%S"]
    answer = ask_slurm(words, timeout_s, {**environ, "SLURM_TIME_FORMAT": "%s"})
    lines = answer.output.strip().splitlines()
    if answer.failure is not None or not lines or not lines[0].strip().isdigit():
        return None
    return float(lines[0].strip()) or None


def show_job(job_id: str, timeout_s: float) -> str | None:
    """``scontrol show job -o <job_id>``: the job's one-line record; None when Slurm cannot
    be asked (no scontrol, a timeout) or does not know the job."""
    answer = ask_slurm(["scontrol", "show", "job", "-o", job_id], timeout_s)
    return answer.output if answer.failure is None and answer.output.strip() else None


def job_field(record: str | None, name: str) -> str | None:
    """The value of ``name=`` in a :func:`show_job` record."""
    match = re.search(rf"\b{re.escape(name)}=(\S+)", record or "")
    return match.group(1) if match else None


def allocation_task_count(job_id: str, timeout_s: float = 10.0) -> int | None:
    """NumTasks of a job; None when Slurm cannot be asked."""
    tasks = job_field(show_job(job_id, timeout_s), "NumTasks")
    return int(tasks) if tasks and tasks.isdigit() else None


def job_allows_requeue(job_id: str, timeout_s: float) -> bool:
    """Whether the job was submitted with --requeue (or the cluster requeues by default)."""
    return job_field(show_job(job_id, timeout_s), "Requeue") == "1"


def time_to_minutes(text: str) -> int:
    """Slurm time formats (MM, HH:MM:SS, D-HH:MM:SS, D-HH, ...) to whole minutes, rounded up."""
    match = _TIME.fullmatch(text.strip())
    if not match:
        raise HpcDdpError(
            f"time {text!r} is not a Slurm time", "write it as HH:MM:SS, D-HH:MM:SS or minutes"
        )
    days, first, second, third = match.groups()
    day_minutes = int(days or 0) * 24 * 60
    if days and second is None:
        return day_minutes + int(first) * 60  # D-HH
    if second is None:
        return int(first)  # MM
    if third is None:
        if days:
            return day_minutes + int(first) * 60 + int(second)  # D-HH:MM
        return int(first) + (1 if int(second) else 0)  # MM:SS
    seconds = day_minutes * 60 + int(first) * 3600 + int(second) * 60 + int(third)
    return max(1, -(-seconds // 60))
