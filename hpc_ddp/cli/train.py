"""`python -m hpc_ddp.train`: the built-in trainer's command line.

python -m hpc_ddp.train --config configs/digits.yaml train.epochs=3 data.batch_size=128
srun python -m hpc_ddp.train --config configs/digits.yaml          # inside sbatch/salloc
python -m hpc_ddp.train --config configs/digits.yaml --dry-run     # the plan, no training
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hpc_ddp.launch.doctor import plan_report
from hpc_ddp.launch.shipped import find_config
from hpc_ddp.runtime.config import OVERRIDES_VARIABLE, environment_overrides
from hpc_ddp.runtime.errors import HpcDdpError, Stopped
from hpc_ddp.runtime.exits import rank_label, report_failure, toolkit_frame
from hpc_ddp.runtime.place.rundir import check_creatable
from hpc_ddp.runtime.session.ending import end_active_run
from hpc_ddp.runtime.session.joining import resolve_launch
from hpc_ddp.runtime.tracking.worker import discard_prestarted
from hpc_ddp.trainer.config import Config, load_config
from hpc_ddp.trainer.datasets import build_datasets
from hpc_ddp.trainer.models import build_model, check_model_takes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hpc_ddp.train",
        description="Train with DDP on the ranks the launcher started (srun, torchrun, "
        "hpc-ddp local, submitit) or as one process.",
    )
    parser.add_argument(
        "--config",
        help="YAML config file, or a shipped one by name (digits, synthetic, parquet, "
        "slurm-gpu); default: built-in defaults",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="resolve the config, the launcher environment and the plan, build data and model "
        "and run one forward pass, without any process group",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.epochs=3")
    return parser


def dry_run(config: Config, environ: Mapping[str, str]) -> dict[str, Any]:
    """``hpc-ddp doctor``'s report of this rank's plan, then the data and the model with one
    sample through it: no process group."""
    plan = resolve_launch(config.runtime, str(config.run.name), environ)
    report = plan_report(plan, (config.data.batch_size, config.train.grad_accum_steps))
    check_creatable(plan.run_dir)
    datasets = build_datasets(config)
    torch.manual_seed(config.run.seed)
    model = build_model(config, datasets.num_features, datasets.num_classes)
    logits = check_model_takes(model, datasets.first_features(), datasets.num_classes)
    train_samples, val_samples = datasets.sizes()
    return {
        **report,
        "train_samples": train_samples,
        "val_samples": val_samples,
        "parameters": sum(p.numel() for p in model.parameters()),
        "logits_shape": list(logits.shape),
    }


def _settings(name: str | None, overrides: Sequence[str], environ: Mapping[str, str]) -> Config:
    """The trainer's settings: the config file ``name`` names, then $HPC_DDP_OVERRIDES
    (hpc-ddp local --set, a job's environment; every section, the trainer's own too), then
    ``overrides`` (which win). start() is then given an environment without the first, so
    they are not applied twice. A mistake in them is the same on every rank."""
    try:
        config_file = find_config(name, Path.cwd()) if name else None
        return load_config(config_file, [*environment_overrides(environ), *overrides])
    except HpcDdpError as error:
        raise HpcDdpError(error.message, error.hint, error.exit_code, True) from None


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Parse, train and return the exit code (README: the exit codes)."""
    from hpc_ddp.trainer.loop import train

    args = build_parser().parse_args(argv)
    environment = os.environ if environ is None else environ
    try:
        config = _settings(args.config, args.overrides, environment)
        if args.dry_run:
            print(json.dumps(dry_run(config, environment), indent=2))
            return 0
        summary = train(config, without_overrides(environment))
    except Stopped as stopped:
        return int(stopped.code or 0)
    except (Exception, KeyboardInterrupt) as error:
        end_active_run(error)
        return report_failure(error, rank_label(environment), toolkit_frame)
    finally:
        discard_prestarted()  # one the run never took (a bad config, a dry run)
    if summary.get("summary_path"):
        print(summary_lines(summary))
    return 0


def without_overrides(environ: Mapping[str, str]) -> dict[str, str]:
    return {key: value for key, value in environ.items() if key != OVERRIDES_VARIABLE}


def summary_lines(summary: Mapping[str, Any]) -> str:
    """Rank 0's last words: what the run did, its validation metrics and where the whole
    summary is (summary.json has everything else)."""
    metrics = "  ".join(
        f"{name} {value:.4f}"
        for name, value in sorted(summary.items())
        if name.startswith("val_") and isinstance(value, float)
    )
    return "\n".join(
        [
            f"run finished: {summary['epochs']} epoch(s), {summary['global_step']} steps on "
            f"{summary['world_size']} rank(s) in {summary['wall_time_s']:.1f} s",
            *([f"  {metrics}"] if metrics else []),
            f"  summary: {summary['summary_path']}",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
