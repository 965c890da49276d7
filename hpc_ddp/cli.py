"""`hpc-ddp`: one command over the toolkit's entry points."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hpc_ddp.config import config_docs


def _local(args: argparse.Namespace) -> int:
    from hpc_ddp.local import launch_local

    train_args = (
        (["--config", args.config] if args.config else [])
        + (["--dry-run"] if args.dry_run else [])
        + list(args.overrides)
    )
    return launch_local(args.nproc, train_args)


def _train(args: argparse.Namespace) -> int:
    from hpc_ddp.train import main as train_main

    return train_main(
        (["--config", args.config] if args.config else [])
        + (["--dry-run"] if args.dry_run else [])
        + list(args.overrides)
    )


def _config(_args: argparse.Namespace) -> int:
    for key, default, doc in config_docs():
        print(f"{key} (default {default})\n    {doc}")
    return 0


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file")
    parser.add_argument("--dry-run", action="store_true", help="print the plan; do not train")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.epochs=3")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpc-ddp", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    local = commands.add_parser("local", help="train on N local CPU ranks (gloo on 127.0.0.1)")
    local.add_argument("--nproc", type=int, default=2, help="number of ranks (default 2)")
    _add_run_arguments(local)
    local.set_defaults(handler=_local)

    train = commands.add_parser("train", help="the training entry point (what srun starts)")
    _add_run_arguments(train)
    train.set_defaults(handler=_train)

    config = commands.add_parser("config", help="list every config key with its default and doc")
    config.set_defaults(handler=_config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
