"""`hpc-ddp check-resume` on real local ranks: a script per mistake that breaks a resume, each
named with its likely cause (exit 1), and scripts whose resume is exact (exit 0): the
README's, the tutorial's own loader converted, the three examples, a clean one (its ranks
started by torchrun too)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, clean_environ, run_local_program
from tests.test_first_hour import readme_script

MISTAKES = str(REPO / "tests" / "programs" / "resume_mistakes.py")


def check_resume(*arguments: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpc_ddp", "check-resume", *arguments],
        cwd=cwd, env=clean_environ(), capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("mistake", "named"),
    [
        ("scheduler", "the optimizer's param_groups[0]['lr'] differs after the resume (0.045000"),
        # An optimizer with state is saved through DCP, its settings as values of their own.
        ("scheduler-adam", "the optimizer's param_groups[0]['lr'] differs after the resume (0.04"),
        ("counter", "the logged metric interval/seen differs at step 21 after the resume"),
        ("loader", "objects.model.weight differs after the resume"),
        (
            "optimizer",
            "the runs warned of state a resume gets wrong: an optimizer (AdamW) steps "
            "the registered model but is not registered",
        ),
        (
            "second-model",
            "the runs warned of state a resume gets wrong: a model given to "
            "run.wrap (the 2nd: Linear, 5 parameters) is not registered",
        ),
    ],
)
@pytest.mark.e2e
def test_a_mistake_that_breaks_the_resume_is_found_and_named(
    mistake: str, named: str, tmp_path: Path
) -> None:
    result = check_resume(
        "--steps", "40", "--stop-at", "20", "--output-dir", str(tmp_path), MISTAKES, mistake
    )
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    verdict = result.stdout.splitlines()[0]
    assert verdict.startswith(f"check-resume: {named}"), result.stdout
    causes = {
        "scheduler": "a learning-rate scheduler is not registered",
        "scheduler-adam": "a learning-rate scheduler is not registered",
        "counter": "the script keeps an unregistered counter or total",
        "loader": "the data order differs, or state the script keeps is not registered",
        "optimizer": "saved value(s) differ after the resume, the first objects.model.weight; "
        "40 steps, stopped at 20)",
        # Its weights are in no checkpoint: only the warning shows them missing.
        "second-model": "(what the checkpoints hold and the metrics logged agree; 40 steps, "
        "stopped at 20)",
    }
    assert verdict.endswith(causes[mistake]), verdict
    assert "  HINT: " in result.stdout and f"kept in {tmp_path}" in result.stdout
    assert sorted(path.name for path in tmp_path.glob("*.log")) == [
        "resumed.log", "stopped.log", "straight.log"
    ]  # fmt: skip


@pytest.mark.parametrize(
    "program",
    [
        # Under local ranks a clean script is the README's, next.
        pytest.param(["--launcher", "torchrun", MISTAKES, "clean"], id="clean-torchrun"),
        pytest.param(["train.py"], id="readme"),
        # The tutorial's own DataLoader, sampler and dropout, converted as docs/converting.md
        # says; resumed in its first epoch, so the dropout masks after it need torch's
        # random stream where the run never stopped left it.
        pytest.param([str(REPO / "tests" / "programs" / "tutorial_loader.py")], id="own-loader"),
        # Each example's resume is pinned bitwise by test_examples.py: these repeat it
        # through the check (make test-all).
        pytest.param([str(REPO / "examples" / "tutorial" / "with_hpc_ddp.py"), "5", "2"],
                     id="tutorial", marks=pytest.mark.slow),
        pytest.param([str(REPO / "examples" / "digits_cnn" / "train.py")], id="digits_cnn",
                     marks=pytest.mark.slow),
        pytest.param([str(REPO / "examples" / "lm" / "train.py")], id="lm",
                     marks=pytest.mark.slow),
    ],
)  # fmt: skip
@pytest.mark.e2e
def test_a_script_that_resumes_exactly_passes_the_check(program: list[str], tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(readme_script())
    result = check_resume("--steps", "30", *program, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout.startswith(
        "check-resume: resume is exact for this script (30 steps, stopped at 15)\n"
    ), result.stdout
    assert not list(tmp_path.glob("runs")), "the check's runs are its own, removed when exact"
    launcher = "torchrun" if "torchrun" in program else "local"
    assert f"(3 runs on 2 {launcher} ranks took " in result.stdout


BPTT_LM = str(REPO / "tests" / "programs" / "bptt_lm.py")


@pytest.mark.parametrize("hidden_registered", [True, False])
@pytest.mark.e2e
def test_a_hidden_state_carried_between_batches_resumes_exactly_only_when_registered(
    hidden_registered: bool, tmp_path: Path
) -> None:
    """docs/converting.md's pattern for a recurrent model trained by truncated backprop
    through time: the hidden state registered per rank, the learning rate lowered by hand in
    run.state (at step 20, before the stop at 25), no optimizer. Left out, as the original
    script keeps it, the resumed run's weights differ and the HINT names the cure."""
    extra = [] if hidden_registered else ["--hidden-unregistered"]
    result = check_resume("--steps", "30", "--stop-at", "25", "--output-dir", str(tmp_path),
                          BPTT_LM, *extra)  # fmt: skip
    if hidden_registered:
        assert result.returncode == 0, result.stdout + result.stderr[-3000:]
        assert result.stdout.startswith(
            "check-resume: resume is exact for this script (30 steps, stopped at 25)\n"
        ), result.stdout
        # The learning rate the resume had to bring back was lowered before the stop (the
        # end of epoch 1 is step 20), and a script with no optimizer is not told to add one.
        direct = run_local_program(
            2, ["--set", f"run.output_dir={tmp_path / 'direct'}", BPTT_LM, "--epochs", "2"]
        )
        assert direct.returncode == 0, direct.stderr[-3000:]
        assert direct.stdout.splitlines() == ["LR 5.0", "LR 5.0"], direct.stdout  # both ranks
        assert "WARNING" not in direct.stderr, direct.stderr[-3000:]
        return
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert result.stdout.startswith("check-resume: objects.model."), result.stdout
    assert "a recurrent hidden state) in an object registered with run.register_per_rank" in (
        result.stdout
    )


@pytest.mark.e2e
def test_a_resume_on_another_number_of_ranks_is_checked_within_the_tolerance(
    tmp_path: Path,
) -> None:
    """--world-size-change 1: stopped on 2 ranks, resumed on 1; the metric sums differ in their
    last bits (summed in another order), which the tolerance allows; the runs on 2 ranks and
    on 1 are in their logs."""
    result = check_resume(
        "--steps", "40", "--stop-at", "20", "--world-size-change", "1",
        "--output-dir", str(tmp_path), MISTAKES, "clean",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout.startswith(
        "check-resume: resume on another number of ranks holds for this script (40 steps, "
        "stopped at 20, resumed on 1 rank(s) instead of 2, within rtol 0.001, atol 1e-05)\n"
    ), result.stdout
    assert "(3 runs on 2 and 1 local ranks took" in result.stdout
    assert "[rank 1/2]" in (tmp_path / "stopped.log").read_text()
    resumed = (tmp_path / "resumed.log").read_text()
    assert "[rank 0/1]" in resumed and "[rank 1/" not in resumed
