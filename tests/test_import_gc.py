"""The garbage collector held off during the built-in trainer's imports, then on again with
torch's objects frozen out of every collection, and frozen again for the exit; a user's
choice to turn it off is kept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, clean_environ

pytestmark = pytest.mark.e2e  # every test here starts processes

ENTRY_POINT = """
import gc, runpy, sys
sys.argv = ["hpc_ddp.train", "--config", "configs/synthetic.yaml", "--dry-run"]
try:
    runpy.run_module("hpc_ddp.train", run_name="__main__")
except SystemExit as end:
    print(end.code, gc.isenabled(), gc.get_freeze_count())
"""

CLI = """
import gc
from hpc_ddp.cli import main
code = main(["train", "--config", "configs/synthetic.yaml", "--dry-run"])
print(code, gc.isenabled(), gc.get_freeze_count())
"""


def _last_line(code: str, *args: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO, env=clean_environ(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1].split()


@pytest.mark.parametrize("code", [ENTRY_POINT, CLI], ids=["python -m hpc_ddp.train", "cli"])
def test_the_trainer_collects_again_with_torchs_objects_frozen(code: str) -> None:
    exit_code, enabled, frozen = _last_line(code)
    assert (exit_code, enabled) == ("0", "True"), "the collector is on again for training"
    assert int(frozen) > 100_000, "torch's import objects are kept out of collections"


RUN_THEN_EXIT = """
import gc, runpy, sys
sys.argv = ["hpc_ddp.train", "--config", "configs/synthetic.yaml", "train.max_steps=2",
            "tracking.enabled=false", "run.output_dir=" + sys.argv[1]]
try:
    runpy.run_module("hpc_ddp.train", run_name="__main__")
except SystemExit as end:
    print(end.code, gc.get_freeze_count(), len(gc.get_objects()))
"""

CLI_RUN_THEN_EXIT = """
import gc, sys
from hpc_ddp.cli import main
code = main(["train", "--config", "configs/synthetic.yaml", "train.max_steps=2",
             "tracking.enabled=false", "run.output_dir=" + sys.argv[1]])
print(code, gc.get_freeze_count(), len(gc.get_objects()))
"""


@pytest.mark.parametrize(
    "code", [RUN_THEN_EXIT, CLI_RUN_THEN_EXIT], ids=["python -m hpc_ddp.train", "cli"]
)
def test_the_trainer_exits_with_its_objects_frozen(code: str, tmp_path: Path) -> None:
    """The run's end lets the collector see every object again (a user's script goes on
    after it); the trainer's process exits next, and its teardown does not walk them all."""
    exit_code, frozen, collectable = _last_line(code, str(tmp_path))
    assert exit_code == "0"
    assert int(frozen) > 100_000 and int(collectable) < 1_000, (frozen, collectable)


def test_a_collector_the_caller_turned_off_stays_off() -> None:
    code = """
import gc
from hpc_ddp.runtime.import_gc import freeze_imports, hold_collection
gc.disable()
hold_collection()
freeze_imports()
print(gc.isenabled(), gc.get_freeze_count())
"""
    assert _last_line(code) == ["False", "0"]
