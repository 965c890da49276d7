"""A callable sent to a job by reference must be importable where the job starts: a module
that only the submitting process's own sys.path reaches (the folder of the script that
submits) is refused before anything is queued, for a sweep and for ``hpc_ddp.submit``.
The job's look-up runs for real (a fresh interpreter in the submission's folder)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

import hpc_ddp
from hpc_ddp.launch.importable import check_importable
from hpc_ddp.runtime.errors import HpcDdpError

pytestmark = pytest.mark.e2e  # every test here starts processes

TRAIN = "def train(lr=0.1):\n    return lr\n"


@pytest.fixture
def script_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[ModuleType, Path]]:
    """``labtrain`` imported from experiments/, as ``python experiments/sweep.py`` would
    (its folder first on sys.path); the process then works in the project's root."""
    experiments, root = tmp_path / "experiments", tmp_path / "project"
    experiments.mkdir()
    root.mkdir()
    (experiments / "labtrain.py").write_text(TRAIN)
    monkeypatch.syspath_prepend(str(experiments))
    monkeypatch.chdir(root)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    module = importlib.import_module("labtrain")
    yield module, experiments
    sys.modules.pop("labtrain", None)


def test_a_sweep_of_a_function_only_the_submitting_script_can_import_is_refused(
    script_module: tuple[ModuleType, Path], tmp_path: Path
) -> None:
    module, experiments = script_module
    with pytest.raises(HpcDdpError) as refused:
        hpc_ddp.submit_sweep(
            module.train, name="s", grid={"lr": [0.1, 0.2]}, output_dir=tmp_path / "out"
        )
    message = str(refused.value)
    assert "every task would import module 'labtrain' by name" in message
    assert f"this process found it in {experiments}" in message
    assert f"HINT: submit from {experiments}, put it on the path (export PYTHONPATH=" in message
    assert not (tmp_path / "out").exists()  # nothing recorded, nothing queued


def test_a_job_of_such_a_function_is_refused_before_submitit_sees_it(
    script_module: tuple[ModuleType, Path], tmp_path: Path
) -> None:
    module, _ = script_module
    with pytest.raises(HpcDdpError, match="every task of the job would import module"):
        hpc_ddp.submit(module.train, cluster="local", folder=tmp_path / "jobs")
    assert not (tmp_path / "jobs").exists()


def test_the_same_function_passes_once_the_jobs_path_reaches_it(
    script_module: tuple[ModuleType, Path],
) -> None:
    module, experiments = script_module
    check_importable(module.train, "every task", Path.cwd(), {"PYTHONPATH": str(experiments)})
    check_importable(module.train, "every task", experiments, {})  # submitted from there


def test_another_copy_in_the_submission_folder_is_named(
    script_module: tuple[ModuleType, Path],
) -> None:
    module, experiments = script_module
    (Path.cwd() / "labtrain.py").write_text(TRAIN)
    with pytest.raises(HpcDdpError) as refused:
        check_importable(module.train, "every task", Path.cwd(), {})
    message = str(refused.value)
    assert f"from {Path.cwd().resolve() / 'labtrain.py'}, not from " in message
    assert str(experiments.resolve() / "labtrain.py") in message
    assert "or remove the other copy" in message


def test_functions_sent_by_value_or_installed_are_not_looked_up() -> None:
    """A script's own function (``__main__``) travels by value; an installed package's is
    found by the job as here."""
    from hpc_ddp.launch.importable import module_file

    def local() -> None: ...

    local.__module__ = "__main__"
    assert module_file(local) is None
    check_importable(hpc_ddp.start, "every task", Path("/"), {})
