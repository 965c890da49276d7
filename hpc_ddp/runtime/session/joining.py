"""A rank joining its run: the launch resolved and checked before any process group, the
rank settled on its machine (logging, threads, open files, what it says), and the process
groups it trains and checkpoints over. The steps :func:`hpc_ddp.start` takes before the run
is built."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as torch_dist

from hpc_ddp.runtime.checkpoint.files import prepare_checkpoint_dir
from hpc_ddp.runtime.checkpoint.writer import needs_own_group
from hpc_ddp.runtime.config import RuntimeConfig
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.exits import leave, report_failure
from hpc_ddp.runtime.logs import get_logger, setup_logging
from hpc_ddp.runtime.monitor.timeline import mark
from hpc_ddp.runtime.place.dist import init_distributed
from hpc_ddp.runtime.place.env import (
    DistEnv,
    available_cpus,
    detect_launcher,
    export_dist_env,
    needs_allocation_task_count,
    resolve_dist_env,
    with_agreed_elastic_restarts,
)
from hpc_ddp.runtime.place.gpus import check_kept_slice, mig_slices, own_mig_slice
from hpc_ddp.runtime.place.limits import open_file_warning, open_files_needed, raise_open_file_limit
from hpc_ddp.runtime.place.plan import (
    LaunchPlan,
    check_socket_interfaces,
    gpu_binding_warning,
    launch_lines,
    make_launch_plan,
    stale_spawn_world,
    threads_per_rank,
)
from hpc_ddp.runtime.place.rundir import claim_run_dir
from hpc_ddp.runtime.place.sharedfs import check_every_rank_sees
from hpc_ddp.runtime.place.slurm import allocation_task_count
from hpc_ddp.runtime.preempt.lost_rank import write_handoff
from hpc_ddp.runtime.preempt.requeue import agent_signal_gap, check_job_signal
from hpc_ddp.runtime.session.ending import install_excepthook


def refuse_a_start_that_cannot_join(environ: Mapping[str, str]) -> None:
    """Refuse, before anything is set up, a start outside the main thread or one that would
    not join the job it belongs to (see :func:`refuse_nested_start`)."""
    if threading.current_thread() is not threading.main_thread():
        raise HpcDdpError(
            f"hpc_ddp.start() called in thread {threading.current_thread().name!r}: stop "
            "signals (preemption, Ctrl-C) reach the main thread only",
            "call hpc_ddp.start() and run the training loop in the main thread",
        )
    multiprocessing_child = multiprocessing.parent_process() is not None
    group_up = torch_dist.is_available() and torch_dist.is_initialized()
    try:
        refuse_nested_start(environ, group_up, multiprocessing_child)
    except HpcDdpError as refused:
        if not multiprocessing_child or group_up:
            raise
        # torch.multiprocessing.spawn would catch it and show its own traceback (exit 1); its
        # children have no rank yet, so each is named by its process name.
        leave(report_failure(refused, multiprocessing.current_process().name))


def resolve_launch(settings: RuntimeConfig, name: str, environ: Mapping[str, str]) -> LaunchPlan:
    """This rank's place, device and run directory, checked before any process group (the
    one place that asks Slurm and torch what they see)."""
    allocation_tasks = None
    if needs_allocation_task_count(environ):
        allocation_tasks = allocation_task_count(environ["SLURM_JOB_ID"])
    dist_env = resolve_dist_env(
        environ,
        settings.dist.master_port,
        single_run_id=time.strftime("single-%Y%m%d-%H%M%S"),
        allocation_tasks=allocation_tasks,
    )
    check_job_signal(environ, settings.preempt.signal)
    check_socket_interfaces(environ, [name for _index, name in socket.if_nameindex()])
    own_slice = own_mig_slice(dist_env)
    if own_slice is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = own_slice  # read when CUDA starts, and only then
    cuda_count = torch.cuda.device_count() if settings.dist.device != "cpu" else 0
    if own_slice is not None and cuda_count > 0:
        seen = f"MIG-{torch.cuda.get_device_properties(0).uuid}"
        check_kept_slice(own_slice, seen, mig_slices(dist_env.cuda_visible_devices))
    return make_launch_plan(settings.dist, settings.run, name, dist_env, cuda_count)


def refuse_nested_start(environ: Mapping[str, str], initialized: bool, child: bool) -> None:
    """Refuse a start that would not join the job it belongs to: a process group already up
    (``init_process_group`` or an earlier :func:`start` not finished), or a
    ``multiprocessing`` child with no launcher (``mp.spawn``), which would train alone at
    world size 1."""
    if initialized:
        raise HpcDdpError(
            "hpc_ddp.start() found a process group already initialized (your own "
            "init_process_group, or an earlier start() whose run did not finish)",
            "remove init_process_group: start() joins the ranks itself; call start() once "
            "per run and end the run with run.finish() before starting another",
        )
    if child and detect_launcher(environ) == "single":
        raise HpcDdpError(
            "hpc_ddp.start() in a process started by multiprocessing (torch.multiprocessing"
            ".spawn?) with no launcher: every such process would train alone at world size 1",
            "replace mp.spawn(main, args=..., nprocs=N) with hpc_ddp.spawn(main, args=..., "
            "nprocs=N), or launch the script with hpc-ddp local --nproc N",
        )


def _raise_open_file_limit(env: DistEnv) -> None:
    """Enough descriptors for this rank's connections at this world size (see limits)."""
    needed = open_files_needed(env.world_size, env.is_main)
    soft, hard, enough = raise_open_file_limit(needed)
    if not enough and env.is_main:
        get_logger().warning(open_file_warning(env.world_size, needed, soft, hard))


def _announce(plan: LaunchPlan, settings: RuntimeConfig, environ: Mapping[str, str]) -> None:
    """One line per rank (where it runs, what it drives); the plan and warnings on rank 0."""
    env, log = plan.dist_env, get_logger()
    log.info(
        f"host {env.hostname} node {env.node_rank}/{env.num_nodes} local_rank {env.local_rank}/"
        f"{env.local_world_size} device {plan.device.device} threads {torch.get_num_threads()}"
    )
    if not env.is_main:
        return
    for line in launch_lines(plan, environ):
        log.info(line)
    for warning in (
        agent_signal_gap(env.launcher, environ, settings.preempt.signal),
        gpu_binding_warning(env, plan.device),
        stale_spawn_world(environ, env.world_size),
    ):
        if warning:
            log.warning(warning)


def _agree_on_elastic_restarts(
    plan: LaunchPlan, group: Any, environ: Mapping[str, str]
) -> LaunchPlan:
    """The plan with torchrun's restart count that every rank agrees on (one all-reduce); rank
    0 says when the workers were restarted."""
    env = plan.dist_env
    counts = torch.tensor([env.elastic_restarts], dtype=torch.int64)
    if group is not None:
        torch_dist.all_reduce(counts, op=torch_dist.ReduceOp.MAX, group=group)
    agreed = with_agreed_elastic_restarts(env, int(counts.item()), environ)
    if agreed.is_main and agreed.elastic_restarts:
        get_logger().warning(
            f"torchrun restarted the workers ({agreed.elastic_restarts} time(s) in this "
            "allocation, at most its --max-restarts): the run goes on from its newest checkpoint"
        )
    return dataclasses.replace(plan, dist_env=agreed)


#: The cuBLAS workspace torch documents for deterministic results (CUDA 10.2 and later).
CUBLAS_DETERMINISTIC = ":4096:8"


def use_deterministic_kernels() -> None:
    """run.deterministic, before any CUDA work of the run (the checks' included): cuBLAS reads
    its workspace setting from the process's environment, so it goes into os.environ (a value
    of the user's own is kept)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    get_logger().debug(
        "run.deterministic: deterministic algorithms, CUBLAS_WORKSPACE_CONFIG="
        f"{os.environ['CUBLAS_WORKSPACE_CONFIG']}, cuDNN deterministic without autotuning"
    )


def _set_threads(env: DistEnv, environ: Mapping[str, str]) -> None:
    """Each rank's intra-op threads: OMP_NUM_THREADS when set (torch reads it), else the CPUs
    Slurm gave the task, else this machine's CPUs shared by its ranks, as `hpc-ddp local` and
    slurm/train.sh do; a bare `srun` or submitit task would otherwise take every core of the
    node, and results would change with the thread count."""
    if not environ.get("OMP_NUM_THREADS"):
        share = threads_per_rank(available_cpus(), env.local_world_size)
        torch.set_num_threads(env.cpus_per_task or share)


def settle_rank(
    plan: LaunchPlan, settings: RuntimeConfig, environ: Mapping[str, str], export_env: bool
) -> None:
    """This rank on its machine: its log lines, the launcher's variables for code that reads
    them, its threads and kernels, enough open files, and what it says of where it runs."""
    dist_env = plan.dist_env
    log = setup_logging(dist_env.rank, dist_env.world_size)
    if export_env:
        for variable, previous in export_dist_env(dist_env, os.environ).items():
            log.debug(f"exported {variable}, replacing {previous!r}")
    _set_threads(dist_env, environ)
    if settings.run.deterministic:
        use_deterministic_kernels()
    _raise_open_file_limit(dist_env)
    _announce(plan, settings, environ)


@dataclasses.dataclass(frozen=True)
class Joined:
    """The groups a joined rank trains over, and its plan once every rank agreed on it."""

    plan: LaunchPlan
    #: Control messages (stop agreement, barriers) over gloo (None at world size 1).
    control_group: Any | None
    #: Background saves' own gloo group, where they need one.
    checkpoint_group: Any | None


def join_ranks(
    plan: LaunchPlan,
    settings: RuntimeConfig,
    environ: Mapping[str, str],
    timeline: dict[str, float],
) -> Joined:
    """The run directory claimed (rank 0, before the process group: a refusal costs no
    rendezvous) and handed to the batch script, the process group joined within
    dist.init_timeout_s, the gloo groups made, torchrun's restart count agreed, and the run
    directory seen by every rank."""
    dist_env = plan.dist_env
    if dist_env.is_main:
        claim_run_dir(plan.run_dir)
        # From here a rank lost to its host (in the rendezvous, the checks, building the
        # model) leaves the host out and the job requeued, as one lost mid-run does.
        write_handoff(environ, plan.run_dir, settings.preempt, "setup")
        if settings.checkpoint.enabled:
            prepare_checkpoint_dir(plan.run_dir)
    init_distributed(dist_env, plan.device, settings.dist, timeline)
    # init_process_group wraps the excepthook in one that holds stderr in a buffer until
    # the hook returns; ours ends the process first, so a refusal would print nothing.
    install_excepthook()
    mark(timeline, "dist_ready")
    # Control messages (stop agreement, barriers) go over gloo on the CPU, so they never
    # force a GPU synchronisation. Each with dist.timeout_s: a group made without one waits
    # torch's 30 minutes.
    limit = timedelta(seconds=settings.dist.timeout_s)
    several = dist_env.world_size > 1
    group = torch_dist.new_group(backend="gloo", timeout=limit) if several else None
    background_saves = settings.checkpoint.enabled and settings.checkpoint.save_mode == "async"
    checkpoint_group = (
        torch_dist.new_group(backend="gloo", timeout=limit)
        if needs_own_group(dist_env.world_size, background_saves, plan.device.backend)
        else None
    )
    mark(timeline, "control_group")
    if dist_env.launcher == "torchelastic":
        plan = _agree_on_elastic_restarts(plan, group, environ)
    if settings.checkpoint.enabled:  # the only files of the run every rank writes
        check_every_rank_sees(plan.run_dir, plan.dist_env.rank, group)
    return Joined(plan, group, checkpoint_group)
