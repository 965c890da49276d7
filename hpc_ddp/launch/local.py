"""`hpc-ddp local`: N CPU ranks on this machine, running the same program Slurm runs.

Ranks meet on 127.0.0.1 at a free port. If one rank fails, the others are stopped at once
and the launcher exits with that rank's code, naming it, instead of leaving the rest to
wait for a collective timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType

from hpc_ddp.launch.output import LOCK_VAR, PREFIX_VAR
from hpc_ddp.launch.program import Program
from hpc_ddp.launch.rank_exits import failure_line, failure_to_report
from hpc_ddp.runtime.errors import EXIT_PEER_LOST, EXIT_STOPPED, HpcDdpError
from hpc_ddp.runtime.place.env import LOCAL_RUN_ID_VAR, available_cpus
from hpc_ddp.runtime.place.plan import threads_per_rank
from hpc_ddp.runtime.preempt.exit_signals import ignore_until_exit

STOP_GRACE_S = 10.0
POLL_INTERVAL_S = 0.1


def free_loopback_port() -> int:
    """A port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def rank_environments(
    nproc: int,
    base: Mapping[str, str],
    port: int,
    run_id: str,
    cpu_count: int,
    output_lock: str | None = None,
) -> list[dict[str, str]]:
    """The environment of each local rank (pure: ``base`` is copied, never changed);
    ``output_lock``: the file through which several ranks take turns to print a line."""
    threads = str(threads_per_rank(cpu_count, nproc))
    environments = []
    for rank in range(nproc):
        environment = dict(base)
        environment.update(
            {
                LOCAL_RUN_ID_VAR: run_id,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
        )
        # Keep gloo on loopback, and N ranks from each starting one thread per core.
        environment.setdefault("GLOO_SOCKET_IFNAME", "lo")
        environment.setdefault("OMP_NUM_THREADS", threads)
        if nproc > 1:  # whole, labelled lines from each (see hpc_ddp.launch.output)
            environment[PREFIX_VAR] = f"[rank {rank}] "
            if output_lock is not None:
                environment[LOCK_VAR] = output_lock
        environments.append(environment)
    return environments


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
            if is_stopped(process.pid):  # SIGTERM waits until a stopped process runs again
                process.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + STOP_GRACE_S
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def end_leftovers(processes: list[subprocess.Popen[bytes]]) -> None:
    """End what the ranks started and left running (their own spawned workers, a helper):
    each rank leads a process group of its own, and a leftover in it would hold the output
    pipe (``hpc-ddp local ... | tee log`` would never return) or sit in a collective."""
    groups = [process.pid for process in processes]
    for ending in (signal.SIGTERM, signal.SIGKILL):
        alive = [group for group in groups if _group_alive(group)]
        if not alive:
            return
        for group in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, ending)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(_group_alive(group) for group in alive):
            time.sleep(POLL_INTERVAL_S)


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP: state T in Linux's /proc; False where
    there is no /proc to say)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[:1] in (["T"], ["t"])


def stopped_ranks(
    processes: Sequence[subprocess.Popen[bytes]], codes: Sequence[int | None]
) -> list[int]:
    """The ranks still running (``codes``: their exit codes so far) whose process is stopped."""
    return [
        rank for rank, code in enumerate(codes) if code is None and is_stopped(processes[rank].pid)
    ]


def supervise(processes: list[subprocess.Popen[bytes]]) -> int:
    """Wait for all ranks; on a failure stop the rest, name the failed rank and return its
    exit code (see :func:`failure_to_report`)."""
    lost_peer_since: float | None = None
    while True:
        codes = [process.poll() for process in processes]
        if lost_peer_since is None and EXIT_PEER_LOST in codes:
            lost_peer_since = time.monotonic()
        waited = 0.0 if lost_peer_since is None else time.monotonic() - lost_peer_since
        stopped = stopped_ranks(processes, codes) if lost_peer_since is not None else []
        failure = failure_to_report(codes, waited, stopped)
        if failure is not None:
            rank, code = failure
            said = failure_line(rank, code, codes, stopped)
            print(f"hpc-ddp local: {said}; stopping the other ranks", file=sys.stderr)
            _stop(processes)
            return code if code > 0 else 128 - code
        if None not in codes:
            return EXIT_STOPPED if EXIT_STOPPED in codes else 0
        time.sleep(POLL_INTERVAL_S)


def _prepare_rank() -> None:
    """In each rank, before it runs: Ctrl-C (SIGINT) at its default action, so that Python
    turns it into the rank's stop. This launcher handles it and passes it on, also when it
    was itself started with SIGINT ignored (a script's background job is): the ranks would
    otherwise inherit that and ignore every Ctrl-C passed on to them.

    And the kernel sends the rank SIGTERM (a stop signal it handles like a preemption) when
    the launcher dies, even by SIGKILL, so no rank trains on unsupervised. Linux only;
    elsewhere the ranks outlive a killed launcher."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if sys.platform != "linux":
        return
    import ctypes

    set_parent_death_signal = 1  # PR_SET_PDEATHSIG
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(set_parent_death_signal, int(signal.SIGTERM), 0, 0, 0)


#: What one CPU rank holds at least once torch is imported (measured: about 0.4 GB).
RANK_MEMORY_BYTES = 500 * 2**20


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable in bytes (Linux), or None."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def crowding_warnings(nproc: int, cpus: int, memory: int | None) -> list[str]:
    """Why ``nproc`` ranks will crowd this machine: more ranks than CPUs, or more than its
    available memory holds (each rank imports torch)."""
    warnings = []
    if nproc > cpus:
        warnings.append(
            f"{nproc} ranks on {cpus} CPU(s): they take turns on the cores, and every "
            f"collective waits for the slowest; results stay the same. HINT: --nproc {cpus} "
            "or fewer runs faster"
        )
    if memory is not None and nproc * RANK_MEMORY_BYTES > memory:
        warnings.append(
            f"{nproc} ranks need about {nproc * RANK_MEMORY_BYTES / 2**30:.1f} GiB (torch in "
            f"each), this machine has {memory / 2**30:.1f} GiB available: ranks may be killed "
            "for memory. HINT: fewer ranks"
        )
    return warnings


def launch_local(nproc: int, program: Program, environ: Mapping[str, str] | None = None) -> int:
    """Start ``nproc`` ranks of ``program`` and supervise them."""
    if nproc < 1:
        raise HpcDdpError(f"--nproc must be >= 1, got {nproc}", "e.g. --nproc 2")
    program.check()
    for warning in crowding_warnings(nproc, available_cpus(), available_memory()):
        print(f"hpc-ddp local: warning: {warning}", file=sys.stderr)
    base = dict(os.environ if environ is None else environ)
    run_id = time.strftime("local-%Y%m%d-%H%M%S-") + str(os.getpid())
    with tempfile.NamedTemporaryFile(prefix="hpc-ddp-output-", suffix=".lock") as lock:
        environments = rank_environments(
            nproc, base, free_loopback_port(), run_id, available_cpus(), lock.name
        )
        return _run_ranks([sys.executable, *program.python_args()], environments)


def _run_ranks(command: list[str], environments: list[dict[str, str]]) -> int:
    """Start one rank per environment, pass the launcher's signals on, supervise them."""
    # The ranks in a process group of their own: a terminal's Ctrl-C reaches this launcher
    # only, which passes each one on exactly once (see interrupt).
    processes = [
        subprocess.Popen(command, env=environment, preexec_fn=_prepare_rank, process_group=0)
        for environment in environments
    ]

    def forward(signum: int, _frame: FrameType | None) -> None:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signum)

    interrupts = []

    def interrupt(signum: int, frame: FrameType | None) -> None:
        """Ctrl-C: the ranks stop after the same step with a checkpoint; a second one makes
        them abort at once; a third ends them."""
        interrupts.append(signum)
        if len(interrupts) > 2:
            for process in processes:
                if process.poll() is None:
                    process.kill()
            return
        forward(signum, frame)

    handlers = {signal.SIGTERM: forward, signal.SIGUSR1: forward, signal.SIGINT: interrupt}
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        code = supervise(processes)
    except KeyboardInterrupt:  # a handler of our own replaced by someone: end the ranks
        _stop(processes)
        return 130
    finally:
        end_leftovers(processes)
        for sig, handler in previous.items():
            if sig == signal.SIGUSR1 and handler in (signal.SIG_DFL, None):
                ignore_until_exit(sig)  # Slurm's warning, late: the ranks' outcome stands
            else:
                signal.signal(sig, handler)
    return 130 if len(interrupts) > 1 and code else code
