"""Checks before the first step: each GPU's known products and free memory, the collective
path, the run directory (a write that reaches the disk, room for the checkpoints kept), a
site's own command; one line per failed host, checks.json, and doctor running the same.

A GPU cannot exist here: the device checks run on the CPU with the same structure, and the
verdicts on a GPU's wrong answers are fed the products such a GPU returns (NaN, Inf, a
wrong entry). tests/test_gpu.py runs them on a real GPU."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpc_ddp.runtime.checkpoint.room import (
    check_room,
    checkpoints_to_come,
    estimated_checkpoint_bytes,
    room_refusal,
    room_warning,
)
from hpc_ddp.runtime.checkpoint.writer import FolderSaves
from hpc_ddp.runtime.config import ChecksConfig
from hpc_ddp.runtime.errors import EXIT_USER_ERROR, HpcDdpError
from hpc_ddp.runtime.place.checking import RankChecks, cost_line, failure_lines
from hpc_ddp.runtime.place.health import (
    Finding,
    ones_finding,
    product_findings,
    reference_finding,
    storage_findings,
    timed,
)
from tests.helpers import REPO, clean_environ, run_local

SMALL = ["data.num_samples=512", "train.epochs=1", "tracking.enabled=false"]


def test_a_product_with_nan_inf_or_a_wrong_entry_is_named_with_its_counts() -> None:
    healthy = torch.full((4, 4), 4.0)
    assert ones_finding(healthy, 4, "gpu cuda:0", torch.bfloat16) == []
    broken = healthy.clone()
    broken[0, 0], broken[1, 1], broken[2, 2], broken[3, 3] = float("nan"), float("inf"), 3.0, 5.0
    (finding,) = ones_finding(broken, 4, "gpu cuda:0", torch.bfloat16)
    assert finding.line() == (
        "gpu cuda:0: ones(4, 4) @ ones in bfloat16: 1 NaN, 1 Inf, 2 wrong of 16 entries; "
        "expected every entry 4"
    )


def test_a_seeded_product_off_its_reference_fails_beyond_the_dtypes_tolerance() -> None:
    assert reference_finding(3.4e-3, "gpu cuda:1", torch.bfloat16) == [], "a healthy H200's"
    (off,) = reference_finding(0.2, "gpu cuda:1", torch.bfloat16)
    assert "off by 0.2 of its largest entry" in off.seen and off.expected == "at most 0.05"
    assert reference_finding(float("nan"), "gpu cuda:1", torch.float32), "NaN is no pass"


def test_the_cpu_computes_its_known_products_at_full_precision_whatever_the_script_set() -> None:
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")  # a script's TF32 or bf16 passes
    try:
        assert product_findings(torch.device("cpu"), torch.float32, 256) == []
        assert torch.get_float32_matmul_precision() == "medium", "the script's setting is back"
    finally:
        torch.set_float32_matmul_precision(before)


def test_a_check_that_raises_is_a_finding_so_every_rank_reaches_the_gather() -> None:
    def crowded() -> list[Finding]:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 MiB")

    seconds: dict[str, float] = {}
    (finding,) = timed(seconds, "devices", crowded)
    assert finding.line() == (
        "devices: OutOfMemoryError: CUDA out of memory. Tried to allocate 16.00 MiB; expected "
        "the check to run without an error"
    )
    assert "devices" in seconds


def test_the_run_directory_takes_a_write_that_reaches_the_disk(tmp_path: Path) -> None:
    assert storage_findings(tmp_path, rank=3) == []
    assert list(tmp_path.iterdir()) == [], "the probe is removed"
    (missing,) = storage_findings(tmp_path / "absent", rank=3)
    assert missing.check == "storage" and "No such file or directory" in missing.seen


def test_failures_are_one_line_per_host_with_its_ranks_and_each_finding_once() -> None:
    bad = Finding("checks.command", "`health` exited with 1: dimm 3", "exit 0")
    every = [
        RankChecks(0, "node1", (), {"devices": 0.2, "storage": 0.01}),
        RankChecks(1, "node2", (bad,), {"devices": 0.3, "command": 1.5}),
        RankChecks(2, "node2", (bad,), {"devices": 0.1}),
    ]
    assert failure_lines(every) == [
        "node2 (ranks 1, 2): checks.command: `health` exited with 1: dimm 3; expected exit 0"
    ]
    assert cost_line(every, None) == (
        "3 rank(s) on 2 host(s): devices 0.30 s, storage 0.01 s, command 1.50 s"
    )
    assert cost_line(every[:1], 12.5).endswith("; all-reduce 12.5 GB/s")


def test_a_checkpoint_is_estimated_with_the_optimizer_state_it_will_hold() -> None:
    model = torch.nn.Linear(10, 10)  # 110 float32 parameters: 440 bytes
    adam = torch.optim.AdamW(model.parameters())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert estimated_checkpoint_bytes({"model": model, "optimizer": adam}) == 440 + 2 * 440
    assert estimated_checkpoint_bytes({"model": model, "optimizer": sgd}) == 440 + 440
    model(torch.ones(1, 10)).sum().backward()
    adam.step()
    stepped = estimated_checkpoint_bytes({"optimizer": adam})
    assert stepped == 2 * 440 + 2 * 4, "two moments and a step count per parameter"
    tied = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    tied[1].weight = tied[0].weight  # one 160-byte matrix under two names
    assert estimated_checkpoint_bytes({"model": tied}) == 160


class Huge:
    """A registered object whose state is 40 TB (on the meta device: nothing allocated)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"weights": torch.empty(10**13, device="meta")}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        del state


def test_checkpoints_that_would_not_fit_are_refused_before_the_first_step(tmp_path: Path) -> None:
    assert room_refusal(tmp_path, each=10**9, count=4, free=4 * 10**9) is None
    refusal = room_refusal(tmp_path, each=10**9, count=4, free=10**9)
    assert refusal is not None
    assert "has 1.00 GB free; 4 more checkpoint(s) of about 1.00 GB each" in refusal.message
    assert "need 4.00 GB" in refusal.message
    assert checkpoints_to_come(keep_last=3, kept=0) == 4
    assert checkpoints_to_come(keep_last=3, kept=3) == 1, "a resumed run adds one at a time"
    resumed = room_refusal(tmp_path, each=10**9, count=1, free=10**8, kept=3)
    assert resumed is not None and "3 already kept there" in resumed.message
    with pytest.raises(HpcDdpError, match=r"4 more checkpoint\(s\) of about 40000\.00 GB"):
        check_room(tmp_path, {"model": Huge()}, keep_last=3, is_main=True, group=None)
    check_room(tmp_path, {"model": torch.nn.Linear(2, 2)}, keep_last=3, is_main=True, group=None)


def test_the_first_checkpoint_is_measured_on_disk_against_the_room_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert room_warning("step-000000010", each=10**9, free=3 * 10**9, keep_last=3, kept=1) is None
    short = room_warning("step-000000010", each=10**9, free=2 * 10**9, keep_last=3, kept=1)
    assert short is not None
    assert short.startswith("checkpoint step-000000010 measured 1.00 GB on disk; the file system")
    assert "the 3 checkpoint(s) to come at once (checkpoint.keep_last + 1, 1 kept now)" in short
    assert "need 3.00 GB: a later save will fail. HINT: free space there" in short
    # A real folder save: the first is measured (a keep_last no disk holds: the warning), once.
    saves = FolderSaves(tmp_path / "checkpoints", 10**12, None, True, measure_room_once=True)
    with caplog.at_level(logging.WARNING, logger="hpc_ddp"):
        saves.write({"weights": torch.ones(1000)}, 10, "periodic", background=False)
        saves.write({"weights": torch.ones(1000)}, 20, "periodic", background=False)
    warnings = [r.message for r in caplog.records if "measured" in r.message]
    assert len(warnings) == 1 and warnings[0].startswith("checkpoint step-000000010 measured")
    quiet = FolderSaves(tmp_path / "other", 1, None, True, measure_room_once=True)
    with caplog.at_level(logging.WARNING, logger="hpc_ddp"):
        quiet.write({"weights": torch.ones(1000)}, 10, "periodic", background=False)
    assert len([r for r in caplog.records if "measured" in r.message]) == 1, "room: no warning"


def test_the_checks_settings_are_checked() -> None:
    with pytest.raises(HpcDdpError, match=r"checks\.min_free_gpu_memory"):
        ChecksConfig(min_free_gpu_memory=2)
    with pytest.raises(HpcDdpError, match=r"checks\.timeout_s"):
        ChecksConfig(timeout_s=0)


@pytest.mark.e2e
def test_a_failing_site_check_ends_every_rank_before_training_naming_the_host(
    tmp_path: Path,
) -> None:
    command = "checks.command=echo 'dimm 3: uncorrectable'; exit 3"
    failed = run_local(2, tmp_path, [*SMALL, "run.id=bad", command])
    assert failed.returncode == EXIT_USER_ERROR, failed.stderr[-3000:]
    line = "checks.command: `echo 'dimm 3: uncorrectable'; exit 3` exited with 3: dimm 3: "
    assert failed.stderr.count(line + "uncorrectable; expected exit 0") == 2, "on both ranks"
    assert "checks before the first step failed on 1 host(s)" in failed.stderr
    assert "HINT: leave the host(s) out: sbatch --exclude=" in failed.stderr
    assert "Traceback" not in failed.stderr
    (run_dir,) = tmp_path.glob("*/bad")
    record = json.loads((run_dir / "checks.json").read_text())
    assert record["passed"] is False and len(record["failures"]) == 1
    assert not list(run_dir.glob("checkpoints/step-*")), "no step was trained"

    passed = run_local(2, tmp_path, [*SMALL, "run.id=good", "checks.command=true"])
    assert passed.returncode == 0, passed.stderr[-3000:]
    assert "checks passed: 2 rank(s) on 1 host(s): devices" in passed.stderr
    (good_dir,) = tmp_path.glob("*/good")
    record = json.loads((good_dir / "checks.json").read_text())
    assert record["passed"] is True
    assert [sorted(rank["seconds"]) for rank in record["ranks"]] == [
        ["collective", "command", "devices", "storage"],
        ["collective", "devices"],
    ], "the run directory and the site's check once per node"


@pytest.mark.e2e
def test_checkpoints_that_cannot_fit_stop_the_run_before_its_first_step(tmp_path: Path) -> None:
    too_many = run_local(2, tmp_path, [*SMALL, "run.id=full", "checkpoint.keep_last=1000000000"])
    assert too_many.returncode == EXIT_USER_ERROR, too_many.stderr[-3000:]
    assert "1000000001 more checkpoint(s) of about" in too_many.stderr
    assert not list(tmp_path.glob("*/full/checkpoints/step-*"))
    unchecked = run_local(
        1, tmp_path, [*SMALL, "run.id=unchecked", "checkpoint.keep_last=1000000000",
                      "checks.enabled=false"]
    )  # fmt: skip
    assert unchecked.returncode == 0, unchecked.stderr[-3000:]
    assert not list(tmp_path.glob("*/unchecked/checks.json")), "checks.enabled=false: none"


@pytest.mark.e2e
def test_doctor_runs_the_same_checks_on_demand(tmp_path: Path) -> None:
    def doctor(*settings: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hpc_ddp", "doctor", "--config", "synthetic",
             f"run.output_dir={tmp_path}", *settings],
            cwd=REPO, env=clean_environ(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    healthy = doctor("checks.command=true")
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert "ok   checks before the first step passed (devices" in healthy.stdout
    failing = doctor("checks.command=echo fan 2 stopped >&2; exit 1")
    assert failing.returncode == 2
    assert "FAIL checks.command: `echo fan 2 stopped >&2; exit 1` exited with 1: fan 2 stopped" in (
        failing.stdout
    )
