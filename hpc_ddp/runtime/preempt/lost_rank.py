"""A rank lost to its host. When srun's step fails, slurm/train.sh's batch script reads what
srun said of each task's end and blames the host of the first task that ended when the
ending is the host's kind: a signal the rank did not ask for (SIGKILL with no out-of-memory
kill, and not of a rank killed while it reported its own stall; SIGSEGV, SIGBUS,
SIGILL), or the rank's own report that its device failed (exit code
EXIT_DEVICE_ERROR). A rank that only lost its peer (EXIT_PEER_LOST) is passed over: its
ending may reach srun before the cause's. The endings after the cause follow from it (srun
ends the step with SIGTERM), and an exit code of the program's own is the program's fault.
SIGABRT is not the host's: NCCL's watchdog aborts every rank of a collective that timed out,
and torch's teardown may abort after an error of the program's.

The batch script cannot know where the run keeps its record (the program's config decides),
so rank 0 writes that, with the preempt settings, to the file HPC_DDP_STEP_HANDOFF names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hpc_ddp.runtime.config import PreemptConfig
from hpc_ddp.runtime.errors import EXIT_DEVICE_ERROR, EXIT_PEER_LOST, HpcDdpError
from hpc_ddp.runtime.logs import get_logger
from hpc_ddp.runtime.safefiles import replace_bytes

#: The file, named by the batch script, where rank 0 says where the run keeps its record.
HANDOFF_VARIABLE = "HPC_DDP_STEP_HANDOFF"

#: srun's line for tasks that ended: "srun: error: node2: task 3: Killed" (anywhere in a
#: line: a rank's last words without a newline may come before it).
_TASK_ENDED = re.compile(
    r"srun: error: (?P<host>[^\s:]+): (?P<tasks>tasks? [0-9,\-\[\]]+): (?P<ending>.+?)\s*$"
)
#: strsignal()'s words, as srun prints them, for the signals that blame the host.
_HOST_SIGNALS = {
    "Killed": "SIGKILL",
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Illegal instruction": "SIGILL",
}
#: slurmstepd's lines when the job's memory limit killed a process: the program's fault.
_OUT_OF_MEMORY = re.compile(r"oom[-_ ]kill|Exceeded (?:job|step) memory limit", re.IGNORECASE)
#: A stall report (hpc_ddp.runtime.preempt.watchdog) by a rank stuck outside torch, after
#: srun's label of its task: srun may kill that rank while it writes it (its peer, waiting
#: inside torch, ended first), and the stall is the program's. One stuck inside torch may
#: wait for its device.
_STALLED = re.compile(
    r"^\s*(?P<task>\d+): .*\brank \d+ stalled: (?!.*its main thread is inside torch)"
)


@dataclass(frozen=True)
class LostRank:
    """The host to leave out, and why in words."""

    host: str
    why: str


def lost_rank(lines: Sequence[str]) -> LostRank | None:
    """The host to blame from the lines of a failed step's log (srun's and the ranks'), or
    None when the first task's ending is not the host's kind."""
    peer_lost = f"Exited with exit code {EXIT_PEER_LOST}"
    endings = [
        match for match in map(_TASK_ENDED.search, lines) if match and match["ending"] != peer_lost
    ]
    if not endings:
        return None
    first = endings[0]
    ending = first["ending"].removesuffix(" (core dumped)")
    where = f"{first['tasks']} on {first['host']}"
    were = "were" if first["tasks"].startswith("tasks") else "was"
    if ending in _HOST_SIGNALS:
        if ending == "Killed" and any(_OUT_OF_MEMORY.search(line) for line in lines):
            return None
        if ending == "Killed" and _reported_a_stall(first["tasks"], lines):
            return None
        frozen = silent_rank(lines, on=first["host"])
        if frozen is not None:
            return frozen  # the kill came after: srun ended a task that did not answer
        return LostRank(first["host"], f"{where} {were} killed by {_HOST_SIGNALS[ending]}")
    if ending == f"Exited with exit code {EXIT_DEVICE_ERROR}":
        return LostRank(first["host"], f"{where} reported a failed device")
    return None


def _reported_a_stall(tasks: str, lines: Sequence[str]) -> bool:
    """Whether a rank of srun's ``tasks`` ("task 1") reported a stall in its own code in
    ``lines`` (under its task's label: a rank under slurm/train.sh, a node's ranks under the
    torchrun template)."""
    task = tasks.removeprefix("task ")
    return task.isdigit() and any(
        found["task"] == task for found in map(_STALLED.search, lines) if found
    )


#: torchrun's account of the round of workers that failed last, when its restarts ran out
#: (torch.distributed.elastic's ChildFailedError): its root cause's fields follow this line.
_ROOT_CAUSE = "Root Cause (first observed failure)"
#: srun's --label: the task (under the torchrun template, the node) a line came from.
_LABEL = re.compile(r"^\s*(?P<task>\d+): ")
_FIELD = re.compile(r"^\s*(?P<name>rank|exitcode)\s*: (?P<value>-?\d+)")
#: torchrun's exit code of a worker killed by a signal: minus the signal's number.
_SIGNAL_EXITS = {-9: "SIGKILL", -11: "SIGSEGV", -7: "SIGBUS", -4: "SIGILL"}


def torchrun_lost_rank(lines: Sequence[str], hosts: Sequence[str]) -> LostRank | None:
    """The host to blame from torchrun's reports of its last failed round (the torchrun job
    template: one srun task per node). Every agent reports its own root cause; one whose
    worker only lost its peer is passed over, and the first other one blames its node when
    its worker was killed by a host-kind signal or reported a failed device. The node is the
    one srun names for the agent's task, else the task's place in ``hosts`` (the job's node
    list). None without such a report, or where nothing names its node."""
    ended = [match for match in map(_TASK_ENDED.search, lines) if match]
    named = {int(match["tasks"].split()[1]): match["host"] for match in ended
             if match["tasks"].split()[1].isdigit()}  # fmt: skip
    for index, line in enumerate(lines):
        label = _LABEL.match(line)
        if _ROOT_CAUSE not in line or label is None:
            continue
        task = int(label["task"])
        host = named.get(task) or (hosts[task] if task < len(hosts) else None)
        fields = _report_fields(lines[index + 1 :], label.group(0))
        code = fields.get("exitcode")
        if host is None or code is None or code == EXIT_PEER_LOST:
            continue
        where = f"rank {fields.get('rank', '?')} on {host} (torchrun's restarts ran out)"
        if code in _SIGNAL_EXITS:
            if code == -9 and any(_OUT_OF_MEMORY.search(line) for line in lines):
                return None
            return LostRank(host, f"{where} was killed by {_SIGNAL_EXITS[code]}")
        if code == EXIT_DEVICE_ERROR:
            return LostRank(host, f"{where} reported a failed device")
        return None
    return None


def _report_fields(after: Sequence[str], label: str) -> dict[str, int]:
    """The rank and exit code of one agent's report: the next lines with its ``label`` (other
    agents' lines may come between), up to its exit code."""
    fields: dict[str, int] = {}
    own = (line[len(label) :] for line in after[:200] if line.startswith(label))
    for line in itertools.islice(own, 12):
        found = _FIELD.match(line)
        if found:
            fields.setdefault(found["name"], int(found["value"]))
        if "exitcode" in fields:
            break
    return fields


def blamed_host(lines: Sequence[str], torchrun_nodes: Sequence[str] | None) -> LostRank | None:
    """The host a failed step's lines blame, or None: srun's words for the first task that
    ended; under the torchrun template (``torchrun_nodes``: the job's node list) torchrun's
    report of its last round; else, where every task only lost its peer or was ended by srun
    after it (a frozen rank, woken to be ended, says the same), the rank a stall report names
    as no longer answering. A program's own ending (an exit code of its own, an
    out-of-memory kill) blames no host."""
    lost = lost_rank(lines)
    if lost is not None:
        return lost
    if torchrun_nodes is not None:
        return torchrun_lost_rank(lines, torchrun_nodes)
    peer_lost = f"Exited with exit code {EXIT_PEER_LOST}"
    endings = [match["ending"] for match in map(_TASK_ENDED.search, lines)
               if match and match["ending"] != peer_lost]  # fmt: skip
    if endings[:1] not in ([], ["Terminated"]) or any(map(_OUT_OF_MEMORY.search, lines)):
        return None
    return silent_rank(lines)


#: A stall report's words for a rank whose watchdog thread stopped writing (see
#: :mod:`hpc_ddp.runtime.preempt.liveness`): "rank 1 on node2 (silent for 3 s)".
_SILENT_SAID = "these ranks stopped answering: "
_SILENT = re.compile(r"rank (?P<rank>\d+) on (?P<host>[^\s(]+) \(silent")


def silent_rank(lines: Sequence[str], on: str | None = None) -> LostRank | None:
    """The host of the first rank (``on`` that host, where given) a stall report names as no
    longer answering (its process frozen, as on a host that hangs: it cannot report itself,
    and srun's words for its end are the others' after it is woken to be ended). None
    without such a report."""
    for line in lines:
        for found in _SILENT.finditer(line.partition(_SILENT_SAID)[2]):
            if found["host"] != "?" and on in (None, found["host"]):
                return LostRank(
                    found["host"], f"rank {found['rank']} on {found['host']} stopped answering"
                )
    return None


#: Where the run was when its rank 0 last wrote the hand-off.
Phase = Literal["setup", "training"]
#: The event a host lost a rank in, as excluded_hosts.json records it, by phase.
LOST_IN = {"setup": "lost a rank before training", "training": "lost a rank"}


def write_handoff(
    environ: Mapping[str, str], run_dir: Path, config: PreemptConfig, phase: Phase
) -> None:
    """Rank 0: where the run keeps its record, the preempt settings and whether it trains
    yet, for the batch script (nothing when the job template asked for none)."""
    path = environ.get(HANDOFF_VARIABLE)
    if path:
        handoff = {"run_dir": str(run_dir), "preempt": dataclasses.asdict(config), "phase": phase}
        try:
            replace_bytes(Path(path), json.dumps(handoff).encode())
        except OSError as error:
            get_logger().warning(f"{path} cannot be written ({error}): a rank lost to its "
                                 "host ends the job instead of leaving the host out")  # fmt: skip


def withdraw_handoff(environ: Mapping[str, str]) -> None:
    """Rank 0 of a run that found itself finished: a rank lost now leaves its files alone."""
    path = environ.get(HANDOFF_VARIABLE)
    if path:
        with contextlib.suppress(OSError):
            Path(path).unlink()


def read_handoff(environ: Mapping[str, str]) -> tuple[Path, PreemptConfig, Phase] | None:
    """What rank 0 handed off this attempt, or None when it wrote nothing readable. The file
    sits in a shared temporary folder under a name others can guess: one that is a link or
    another user's is not trusted."""
    path = environ.get(HANDOFF_VARIABLE)
    if not path:
        return None
    try:
        seen = os.lstat(path)
        if not stat.S_ISREG(seen.st_mode) or seen.st_uid != os.getuid():
            return None
        handoff = json.loads(Path(path).read_text())
        phase = handoff.get("phase", "training")
        if phase not in LOST_IN:
            return None
        return Path(handoff["run_dir"]), PreemptConfig(**handoff["preempt"]), phase
    except (OSError, ValueError, TypeError, KeyError, AttributeError, HpcDdpError):
        return None
