"""The garbage collector held off during the built-in trainer's imports, then on again with
torch's objects frozen out of every collection; a user's choice to turn it off is kept."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO, clean_environ

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


def _last_line(code: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO, env=clean_environ(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1].split()


@pytest.mark.parametrize("code", [ENTRY_POINT, CLI], ids=["python -m hpc_ddp.train", "cli"])
def test_the_trainer_collects_again_with_torchs_objects_frozen(code: str) -> None:
    exit_code, enabled, frozen = _last_line(code)
    assert (exit_code, enabled) == ("0", "True"), "the collector is on again for training"
    assert int(frozen) > 100_000, "torch's import objects are kept out of collections"


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
