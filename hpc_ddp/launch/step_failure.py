"""After srun's step failed, in the job templates' batch scripts: a rank lost to its host (see
:mod:`hpc_ddp.runtime.preempt.lost_rank`; under torchrun, once its restarts in the allocation
ran out) leaves that host out of the job, which is requeued to go on from its last
checkpoint, within ``preempt.max_node_failures``.

    python -m hpc_ddp.launch.step_failure STATUS LOG_FROM

STATUS is srun's exit status and LOG_FROM the size of the job's log (this process's stderr)
before srun started; the exit status is 0 once requeued, EXIT_NODES_FAILED past the budget,
else STATUS."""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpc_ddp.runtime.errors import EXIT_NODES_FAILED

#: Set by the torchrun template: one srun task per node (torchrun's agent).
ONE_TASK_PER_NODE = "HPC_DDP_ONE_TASK_PER_NODE"
#: How much of the log's end is read: srun's lines come after the ranks' last words.
TAIL_BYTES = 8 << 20


def attempt_lines(log_from: int) -> list[str]:
    """The lines this attempt added to the job's log, its end only; [] when stderr is not a
    file (a log sent elsewhere names no task)."""
    try:
        if not stat.S_ISREG(os.fstat(2).st_mode):
            return []
        with open("/proc/self/fd/2", "rb") as log:
            end = log.seek(0, os.SEEK_END)
            log.seek(max(log_from, end - TAIL_BYTES, 0))
            return log.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def answer(status: int, lines: Sequence[str], environ: Mapping[str, str]) -> int:
    """Leave the lost rank's host out and requeue; the batch script's exit status."""
    from hpc_ddp.runtime.place.slurm import expand_hostlist
    from hpc_ddp.runtime.preempt.lost_rank import blamed_host, read_handoff

    # Under the torchrun template srun's task N is the agent of node N of the job's list.
    nodelist = environ.get("SLURM_JOB_NODELIST", "")
    per_node = environ.get(ONE_TASK_PER_NODE) == "1"
    lost = blamed_host(lines, (expand_hostlist(nodelist) if nodelist else []) if per_node else None)
    if lost is None:
        return status
    handoff = read_handoff(environ)
    if handoff is None:
        print(f"hpc-ddp: {lost.why}; rank 0 said nothing of its run, so {lost.host} is not "
              "left out and the job not requeued\nHINT: a rank lost before rank 0 claimed the "
              "run's directory (while Python imported, or rank 0's own host lost) ends the "
              f"job; resubmit it with --exclude={lost.host}", file=sys.stderr)  # fmt: skip
        return status
    from hpc_ddp.runtime.preempt.exclusion import leave_out
    from hpc_ddp.runtime.preempt.lost_rank import LOST_IN

    run_dir, config, phase = handoff
    if phase == "setup" and lost_before_training_before(run_dir, environ):
        print(f"hpc-ddp: {lost.why} before training, as in this job's attempt before: the "
              "program's own start, not a host, is the likelier cause; not requeueing\nHINT: "
              f"run it outside the job (hpc-ddp local) to see the crash; {run_dir}/"
              "excluded_hosts.json names the hosts left out before", file=sys.stderr)  # fmt: skip
        return status
    outcome, line = leave_out([lost.host], [lost.why], run_dir, environ, config, LOST_IN[phase])
    if line:
        print(f"hpc-ddp: {lost.why}: {line}", file=sys.stderr)
    if outcome == "exhausted":
        print("HINT: have the hosts repaired (tell the admins), or raise "
              "preempt.max_node_failures", file=sys.stderr)  # fmt: skip
        return EXIT_NODES_FAILED
    return 0 if outcome == "requeued" else status


def lost_before_training_before(run_dir: Path, environ: Mapping[str, str]) -> bool:
    """Whether this job's attempt just before this one was requeued after a rank lost before
    training: a second such loss in a row is more likely the program's (a crash of its own
    in building the model) than another bad host, and requeueing again would cost one more
    wait in the queue and one more good host each time."""
    from hpc_ddp.runtime.place.slurm import queue_job_id
    from hpc_ddp.runtime.preempt.lost_rank import LOST_IN
    from hpc_ddp.runtime.preempt.node_record import node_failures, of_job

    restart = int(environ.get("SLURM_RESTART_COUNT", "0") or 0)
    return any(
        failure.get("event") == LOST_IN["setup"] and failure.get("requeued")
        and failure.get("restart_count") == restart - 1
        for failure in of_job(node_failures(run_dir), queue_job_id(environ))
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if len(words) != 2 or not all(word.isdigit() for word in words):
        print(f"usage: python -m hpc_ddp.launch.step_failure STATUS LOG_FROM (got {words})",
              file=sys.stderr)  # fmt: skip
        return 2
    status, log_from = int(words[0]), int(words[1])
    try:
        return answer(status, attempt_lines(log_from), os.environ)
    except Exception as error:  # the job's own status must stand
        print(f"hpc-ddp: the failed step was not answered ({type(error).__name__}: {error}); "
              f"the job ends with srun's status {status}", file=sys.stderr)  # fmt: skip
        return status


if __name__ == "__main__":
    sys.exit(main())
