"""The training entry point every launcher runs: srun, hpc-ddp local, torchrun and submitit.

python -m hpc_ddp.train --config configs/digits.yaml train.epochs=3 data.batch_size=128
srun python -m hpc_ddp.train --config configs/digits.yaml          # inside sbatch/salloc
python -m hpc_ddp.train --config configs/digits.yaml --dry-run     # the plan, no training
"""

from __future__ import annotations

from hpc_ddp.startup_signals import hold_stop_signals

if __name__ == "__main__":
    # Before the seconds of importing torch: a stop signal then must not kill the rank.
    hold_stop_signals()

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from hpc_ddp.checkpoint import (
    check_resumable,
    checkpoint_dir,
    load_newest,
    remove_partial_writes,
    resume_fingerprint,
)
from hpc_ddp.config import Config, config_to_dict, flatten, load_config
from hpc_ddp.data import build_datasets
from hpc_ddp.dist import init_distributed, shutdown_distributed
from hpc_ddp.env import (
    DistEnv,
    export_dist_env,
    needs_allocation_task_count,
    resolve_dist_env,
)
from hpc_ddp.errors import (
    EXIT_FAILURE,
    EXIT_PEER_LOST,
    EXIT_STOPPED,
    EXIT_USER_ERROR,
    HpcDdpError,
    lost_peer,
)
from hpc_ddp.logs import get_logger, setup_logging
from hpc_ddp.loop import Trainer
from hpc_ddp.models import build_model
from hpc_ddp.plan import RunPlan, describe_plan, gpu_binding_warning, make_plan
from hpc_ddp.preempt import StopSignals, agent_signal_gap, requeue_job
from hpc_ddp.slurm import allocation_task_count
from hpc_ddp.tracking import NullTracker, Tracker, run_tags, start_tracker


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hpc_ddp.train",
        description="Train with DDP on the ranks the launcher started (srun, torchrun, "
        "hpc-ddp local, submitit) or as one process.",
    )
    parser.add_argument("--config", help="YAML config file (default: built-in defaults)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="resolve the config, the launcher environment and the plan, build data and model "
        "and run one forward pass, without any process group",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.epochs=3")
    return parser


def resolve(config: Config, environ: Mapping[str, str]) -> RunPlan:
    """Environment and plan: everything checked before any process group exists."""
    allocation_tasks = None
    if needs_allocation_task_count(environ):
        allocation_tasks = allocation_task_count(environ["SLURM_JOB_ID"])
    dist_env = resolve_dist_env(
        environ,
        config.dist.master_port,
        single_run_id=time.strftime("single-%Y%m%d-%H%M%S"),
        allocation_tasks=allocation_tasks,
    )
    cuda_count = torch.cuda.device_count() if config.dist.device != "cpu" else 0
    return make_plan(config, dist_env, cuda_count, os.cpu_count() or 1)


def dry_run(config: Config, plan: RunPlan) -> dict[str, Any]:
    """Build the data and the model and push one batch through it: no process group."""
    datasets = build_datasets(config)
    torch.manual_seed(config.run.seed)
    model = build_model(config, datasets.num_features, datasets.num_classes)
    logits = model(datasets.first_features().unsqueeze(0))
    train_samples, val_samples = datasets.sizes()
    return {
        "plan": describe_plan(plan),
        "train_samples": train_samples,
        "val_samples": val_samples,
        "parameters": sum(p.numel() for p in model.parameters()),
        "logits_shape": list(logits.shape),
    }


def _start_tracker(
    config: Config, plan: RunPlan, resume: tuple[Path, dict[str, Any]] | None
) -> Tracker:
    env = plan.dist_env
    return start_tracker(
        enabled=config.tracking.enabled,
        is_main=env.is_main,
        tracking_uri=config.tracking.uri,
        output_dir=config.run.output_dir,
        experiment=config.tracking.experiment,
        run_name=config.run.name,
        params=flatten(config),
        tags=run_tags(env.launcher, env.world_size, env.num_nodes, env.job_id, env.restart_count),
        resume_run_id=resume[1].get("mlflow_run_id") if resume else None,
        start_step=int(resume[1]["global_step"]) if resume else 0,
    )


def _broadcast(value: Any, group: Any | None) -> Any:
    """Rank 0's ``value`` on every rank."""
    if group is None:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0, group=group)
    return holder[0]


def find_resume(
    config: Config, plan: RunPlan, group: Any | None
) -> tuple[Path, dict[str, Any]] | None:
    """The newest good checkpoint of this run (rank 0 chooses, every rank loads the same)."""
    if not config.checkpoint.resume:
        return None
    directory = checkpoint_dir(plan.run_dir)
    found = None
    if plan.dist_env.is_main:
        remove_partial_writes(directory)
        found = load_newest(directory)
    chosen = _broadcast(str(found[0]) if found else "", group)
    if not chosen:
        return None
    path = Path(chosen)
    state = found[1] if found else torch.load(path, map_location="cpu", weights_only=True)
    check_resumable(state["fingerprint"], resume_fingerprint(config), path)
    return path, state


def write_outputs(run_dir: Path, summary: dict[str, Any], model: torch.nn.Module) -> Path:
    """summary.json and the final weights (model.pt, a plain state_dict), each replaced
    atomically so a reader never sees half a file.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    weights = run_dir / "model.pt"
    torch.save(model.state_dict(), weights.with_suffix(".pt.tmp"))
    os.replace(weights.with_suffix(".pt.tmp"), weights)
    path = run_dir / "summary.json"
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    os.replace(temporary, path)
    return path


def _finish_stopped(
    config: Config, plan: RunPlan, signals: StopSignals, tracker: Tracker, group: Any | None
) -> bool:
    """After a stop checkpoint: rank 0 requeues if asked and allowed; all ranks learn the
    outcome before exiting, so none exits early and kills rank 0 mid-requeue."""
    env = plan.dist_env
    requeued = False
    if env.is_main:
        if signals.wants_requeue:
            tracker.suspend()  # before requeueing: Slurm ends this step right after it
            requeued = requeue_job(os.environ, env.restart_count, config.preempt)
        if not requeued:
            tracker.finish("KILLED")
    return bool(_broadcast(requeued, group))


def train(config: Config, plan: RunPlan, started: float, signals: StopSignals) -> dict[str, Any]:
    """Run the whole training on this rank; returns the summary (written by rank 0)."""
    env: DistEnv = plan.dist_env
    log = get_logger()
    timeline = {"entry_unix": time.time() - (time.perf_counter() - started)}
    init_distributed(env, plan.device, config.dist)
    timeline["dist_ready_unix"] = time.time()
    # Control messages (stop agreement, checkpoint barriers) go over gloo on the CPU, so they
    # never force a GPU synchronisation.
    group = dist.new_group(backend="gloo") if env.world_size > 1 else None
    tracker: Tracker = NullTracker()
    try:
        resume = find_resume(config, plan, group)
        tracker = _start_tracker(config, plan, resume)
        timeline["tracker_ready_unix"] = time.time()
        datasets = build_datasets(config)
        timeline["data_ready_unix"] = time.time()
        torch.manual_seed(config.run.seed)  # identical initial weights on every rank
        model = build_model(config, datasets.num_features, datasets.num_classes)
        torch.manual_seed(config.run.seed + env.rank)  # per-rank stream for dropout etc.
        trainer = Trainer(config, plan, datasets, model, tracker, signals, group)
        if resume:
            trainer.restore(resume[1])
            log.info(
                f"resumed from {resume[0]} at step {trainer.state.global_step} (epoch "
                f"{trainer.state.epoch}, step {trainer.state.step_in_epoch} of the epoch)"
            )
        state = trainer.fit(resume_fingerprint(config))
        summary = trainer.summary(time.perf_counter() - started)
        summary["mlflow_run_id"] = tracker.run_id
        summary["timeline"] = timeline
        summary["run_id"] = plan.run_dir.name
        if state.stopped:
            summary["requeued"] = _finish_stopped(config, plan, signals, tracker, group)
            shutdown_distributed()
            return summary
        if env.is_main:
            path = write_outputs(plan.run_dir, summary, trainer.model.module)
            tracker.log_json_artifact("summary.json", summary)
            tracker.log_text_artifact("config.yaml", yaml.safe_dump(config_to_dict(config)))
            summary["summary_path"] = str(path)
            log.info(f"summary: {path}")
    except BaseException:
        tracker.finish("FAILED")
        raise
    tracker.finish("FINISHED")
    shutdown_distributed()
    return summary


def run(
    config: Config,
    environ: Mapping[str, str],
    export_to: MutableMapping[str, str] | None = None,
) -> dict[str, Any]:
    """Resolve, train and return this rank's summary; raises on any failure.

    ``export_to`` (normally ``os.environ``) receives RANK, MASTER_ADDR, ... for user code
    that reads them; that is the only place the environment is written.
    """
    started = time.perf_counter()
    plan = resolve(config, environ)
    log = setup_logging(plan.dist_env.rank, plan.dist_env.world_size)
    if export_to is not None:
        for name, previous in export_dist_env(plan.dist_env, export_to).items():
            log.debug(f"exported {name}, replacing {previous!r}")
    env = plan.dist_env
    # One line per rank: where it runs and what it drives, for reading a multi-node log.
    log.info(
        f"host {env.hostname} node {env.node_rank}/{env.num_nodes} local_rank {env.local_rank}/"
        f"{env.local_world_size} device {plan.device.device} master {env.master_addr}:"
        f"{env.master_port}"
    )
    if env.is_main:
        log.info(describe_plan(plan))
        for warning in (
            agent_signal_gap(env.launcher, environ, config.preempt.signal),
            gpu_binding_warning(env, plan.device),
        ):
            if warning:
                log.warning(warning)
    signals = StopSignals(config.preempt.signal, config.preempt.stop_on_sigterm).install()
    try:
        return train(config, plan, started, signals)
    finally:
        signals.restore()


def report_outcome(summary: dict[str, Any]) -> int:
    """Print what happened and return the exit code: 0 finished or requeued, 3 stopped."""
    if summary.get("summary_path"):
        print(json.dumps(summary, indent=2, sort_keys=True))
    if not summary.get("stopped_early"):
        return 0
    if summary.get("requeued"):
        get_logger().info(f"stopped at step {summary['global_step']}; the job was requeued")
        return 0
    get_logger().warning(
        f"stopped at step {summary['global_step']} after a checkpoint; to continue, run the "
        f"same command with run.id={summary['run_id']}"
    )
    return EXIT_STOPPED


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Parse, resolve, train; prints errors with a HINT and returns the exit code."""
    args = build_parser().parse_args(argv)
    environment = os.environ if environ is None else environ
    rank_label = environment.get("SLURM_PROCID") or environment.get("RANK") or "0"
    try:
        config = load_config(args.config, args.overrides)
        if args.dry_run:
            print(json.dumps(dry_run(config, resolve(config, environment)), indent=2))
            return 0
        summary = run(config, environment, os.environ if environ is None else None)
        return report_outcome(summary)
    except HpcDdpError as error:
        print(f"[rank {rank_label}] error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"[rank {rank_label}] interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        peer_gone = lost_peer(error)
        if peer_gone:
            print(
                f"[rank {rank_label}] stopped: another rank went away during a collective "
                f"({peer_gone[:300]}); that rank's output shows the cause",
                file=sys.stderr,
            )
            return EXIT_PEER_LOST
        print(f"[rank {rank_label}] failed:\n{traceback.format_exc()}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
