"""The code and environment of each attempt (provenance.json), in this process: what a
resume compares and names, the warning and the refusal, and the record kept. The records'
git and package parts on real ranks: test_user_script.py."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.runtime.safefiles import read_records
from hpc_ddp.runtime.tracking import provenance
from hpc_ddp.runtime.tracking.provenance import (
    RECORD,
    AttemptCode,
    environment_of,
    what_changed,
)
from hpc_ddp.view.runs import code_line

ATTEMPT: dict[str, Any] = {
    "script": "/home/me/train.py", "script_sha256": "a" * 64, "git_commit": "c1", "git_dirty":
    False, "git_diff_sha256": None, "python": "3.11.2", "torch": "2.13.0", "cuda": None,
    "nccl": None, "hpc_ddp": "0.1.0", "packages": ["numpy==2.1.0", "torch==2.13.0"],
}  # fmt: skip


def test_a_resume_names_every_difference_of_code_versions_and_packages() -> None:
    now = {**ATTEMPT, "script_sha256": "b" * 64, "torch": "2.14.0",
           "packages": ["numpy==2.2.0", "torch==2.14.0", "tqdm==4.0"]}  # fmt: skip
    assert what_changed(ATTEMPT, ATTEMPT) == []
    assert what_changed(ATTEMPT, now) == [
        f"the script's contents (sha256): {'a' * 64} -> {'b' * 64}",
        "torch: 2.13.0 -> 2.14.0",
        "packages: numpy==2.2.0, torch==2.14.0, tqdm==4.0 installed, numpy==2.1.0, "
        "torch==2.13.0 gone",
    ]


def test_a_changed_resume_warns_or_is_refused_and_every_attempt_is_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def check_code(run_dir: Path, now: dict[str, Any], resumed: bool, on_change: str) -> Any:
        return provenance.check_code(
            run_dir, read_records(run_dir / RECORD, "python"), now, resumed, on_change
        )

    edited = {**ATTEMPT, "git_dirty": True, "git_diff_sha256": "d" * 64}
    assert check_code(tmp_path, ATTEMPT, False, "refuse") is None  # a first attempt
    with caplog.at_level(logging.WARNING, logger="hpc_ddp"):
        assert check_code(tmp_path, edited, True, "warn") is None
    assert caplog.messages == [
        "this attempt resumes a run whose last attempt ran other code or another environment: "
        f"the uncommitted changes (sha256 of git diff HEAD): None -> {'d' * 64} "
        "(run.on_code_change=refuse refuses this)"
    ]
    refusal = check_code(tmp_path, ATTEMPT, True, "refuse")
    assert refusal is not None and refusal.exit_code == 2
    assert f"uncommitted changes (sha256 of git diff HEAD): {'d' * 64} -> None" in str(refusal)
    assert "git checkout c1" in str(refusal) and "run.on_code_change=warn" in str(refusal)
    kept = json.loads((tmp_path / RECORD).read_text())
    assert [attempt["git_diff_sha256"] for attempt in kept] == [None, "d" * 64]
    # Started afresh (no resume), nothing is compared.
    assert check_code(tmp_path, {**ATTEMPT, "python": "3.12.0"}, False, "refuse") is None


def test_the_environment_names_this_process_versions_and_packages() -> None:
    environment = environment_of()
    assert environment["torch"] == __import__("torch").__version__
    assert any(package.startswith("torch==") for package in environment["packages"])
    assert environment["packages"] == sorted(environment["packages"])


def test_mlflow_gets_the_attempts_code_as_tags_and_its_packages_and_diff_as_files() -> None:
    """What MLflow shows of an attempt: its own source tags (the UI's), the script's hash,
    the tree's state and the versions; an unknown one (no CUDA here) is empty, so that it
    replaces what an earlier attempt of the run set."""
    clean = AttemptCode(ATTEMPT, None, 0)
    packages_sha256 = hashlib.sha256(b"numpy==2.1.0\ntorch==2.13.0").hexdigest()
    assert clean.tags() == {
        "mlflow.source.name": "/home/me/train.py",
        "mlflow.source.git.commit": "c1",
        "hpc_ddp.code.script_sha256": "a" * 64,
        "hpc_ddp.code.git_dirty": "false",
        "hpc_ddp.code.git_diff_sha256": "",
        "hpc_ddp.env.python": "3.11.2",
        "hpc_ddp.env.torch": "2.13.0",
        "hpc_ddp.env.cuda": "",
        "hpc_ddp.env.nccl": "",
        "hpc_ddp.env.hpc_ddp": "0.1.0",
        "hpc_ddp.env.packages_sha256": packages_sha256,
    }
    assert clean.artifacts() == {
        "provenance/attempt-0/packages.txt": "numpy==2.1.0\ntorch==2.13.0\n"
    }
    edited = AttemptCode({**ATTEMPT, "git_dirty": True}, "+x = 1\n", 2)
    assert edited.tags()["hpc_ddp.code.git_dirty"] == "true"
    assert edited.artifacts()["provenance/attempt-2/git.diff"] == "+x = 1\n"


@pytest.mark.e2e
def test_an_array_tasks_attempt_names_its_job_as_squeue_and_its_log_do(tmp_path: Path) -> None:
    """An array task's SLURM_JOB_ID is a number of its own (36); squeue, sacct, the sweep's
    status and the %A_%a log name call it 34_1, and so do the run's attempts (e2e: the
    record asks git about the running script)."""
    environ = {"SLURM_JOB_ID": "36", "SLURM_ARRAY_JOB_ID": "34", "SLURM_ARRAY_TASK_ID": "1"}
    attempt = provenance.agree_on_code(tmp_path, True, False, "warn", environ, None)
    assert attempt is not None and attempt.record["job"] == "34_1"
    [kept] = read_records(tmp_path / RECORD, "python")
    assert kept["job"] == "34_1"
    assert code_line(1, kept).startswith("attempt 1 (") and ", job 34_1): " in code_line(1, kept)
    alone = {"SLURM_JOB_ID": "7"}
    plain = provenance.agree_on_code(tmp_path / "plain", True, False, "warn", alone, None)
    assert plain is not None and plain.record["job"] == "7"
