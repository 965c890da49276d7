"""Every bad input of tests/bad_inputs.py gets its one-line answer and exit code, without a
traceback; docs/reliability.md lists them all. The entry points run in this process (their
`main` functions, as `hpc-ddp` and `python -m hpc_ddp.train` call them): every case is
refused before any process group or training starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpc_ddp.cli import main as cli_main
from hpc_ddp.cli.check_resume import CHECK_SETTINGS
from hpc_ddp.cli.commands import check_settings
from hpc_ddp.cli.train import main as train_main
from hpc_ddp.launch.program import Program
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.trainer.config import load_config
from tests.bad_inputs import CASES, FAULTS, Case, table
from tests.helpers import REPO, clean_environ, run_python

#: What a message may not contain: a traceback, or an internal name leaking out.
NEVER = ("Traceback", "data_command", "Namespace(")


def answer(case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """(exit code, everything printed) of ``case``."""
    try:
        if case.kind == "cli":
            code = cli_main(list(case.args))
        elif case.kind == "script":
            return run_script(case, tmp_path)
        elif case.kind == "train":
            environ = {**clean_environ(), **case.environ}
            code = train_main([*case.args, "--dry-run"], environ)
        else:
            config = tmp_path / "config.yaml"
            config.write_text(case.text)
            code = train_main(["--config", str(config), "--dry-run"], clean_environ())
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code if isinstance(exit_.code, int) else 1
    printed = capsys.readouterr()
    return code, printed.out + printed.err


def run_script(case: Case, tmp_path: Path) -> tuple[int, str]:
    """A user's script of one rank, run by plain python in its own folder."""
    (tmp_path / "script.py").write_text(f"import torch, hpc_ddp\n{case.text}\n")
    result = run_python(["script.py"], cwd=tmp_path)
    return result.returncode, result.stdout + result.stderr


def test_there_are_at_least_120_bad_inputs() -> None:
    assert len(CASES) >= 120
    assert len({(case.kind, case.args, case.text, str(case.environ)) for case in CASES}) == len(
        CASES
    ), "each case is tried once"


@pytest.mark.parametrize(
    "case",
    # A script case runs the user's script in a process of its own: end to end.
    [pytest.param(case, marks=pytest.mark.e2e if case.kind == "script" else ()) for case in CASES],
    ids=[f"{n}" for n in range(1, len(CASES) + 1)],
)
def test_a_bad_input_gets_its_one_line_answer(
    case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "no-cluster.conf"))  # never ask DNS
    code, printed = answer(case, tmp_path, capsys)
    assert code == case.code, printed[-2000:]
    assert case.says in printed, printed[-2000:]
    assert not [word for word in NEVER if word in printed], printed[-2000:]
    if case.code == 2:
        assert "HINT:" in printed or "usage:" in printed, printed[-2000:]
    assert not (REPO / "PWNED").exists()


def test_the_reliability_page_lists_every_case() -> None:
    page = (REPO / "docs" / "reliability.md").read_text()
    assert page == table(), "regenerate: python -m tests.bad_inputs > docs/reliability.md"


def test_every_fault_names_a_test_that_exists() -> None:
    for _fault, _outcome, test in FAULTS:
        module, name = test.split("::")
        assert f"def {name}(" in (REPO / "tests" / module).read_text(), test


def test_no_case_leaves_files_in_the_checkout() -> None:
    assert not [name for name in os.listdir(REPO) if name in ("PWNED", "x", "job.sh")]


def test_doctor_fails_the_check_of_a_job_signal_the_ranks_do_not_handle() -> None:
    from hpc_ddp.launch.doctor import diagnose
    from hpc_ddp.trainer.config import load_config

    config = load_config(str(REPO / "configs/synthetic.yaml"), ["preempt.signal=USR2"])
    report = diagnose(config.runtime, {**clean_environ(), "HPC_DDP_JOB_SIGNAL": "USR1"})
    assert report["ok"] is False
    (status, text), *_ = report["checks"]
    assert status == "FAIL" and "the job's warning signal is 'USR1'" in text
    assert diagnose(config.runtime, {**clean_environ(), "HPC_DDP_JOB_SIGNAL": "USR2"})["ok"]


def test_a_set_is_judged_with_the_settings_the_ranks_put_around_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--set` is checked before any rank starts, with what the ranks apply around it: the
    built-in trainer's config file and the overrides after it, $HPC_DDP_OVERRIDES, the
    check's own settings; a setting that is wrong names itself with its own answer."""
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("HPC_DDP_OVERRIDES", raising=False)
    gpu_config = Program("builtin", "configs/slurm-gpu.yaml")
    check_settings(["model.stages=4"], gpu_config, {})  # 4 stages: that file's 3 layers allow it
    with pytest.raises(HpcDdpError, match=r"expected 1 to 3"):
        load_config(None, ["model.stages=4"])  # ... where the defaults' 2 layers do not
    factory_after = Program("builtin", "", ("data.factory=pkg.mod:make",))
    check_settings(["data.kind=custom"], factory_after, {})
    custom = {"HPC_DDP_OVERRIDES": "data.kind=custom data.factory=a.b:c"}
    check_settings(["data.factory=x.y:z"], Program("builtin", ""), custom)
    check_settings(["train.epochs=1"], Program("module", "hpc_ddp.train"), {})

    script = Program("script", "train.py")
    with pytest.raises(HpcDdpError) as refused:
        check_settings(["preempt.max_requeues=-1", "checkpoint.keep_last=0"], script, {})
    assert refused.value.message == (
        "--set 'preempt.max_requeues=-1': preempt.max_requeues=-1 is invalid: expected >= 0"
    )
    with pytest.raises(HpcDdpError) as refused:
        check_settings(["dist.backend=nccl"], script, {}, after=CHECK_SETTINGS)
    assert refused.value.message.startswith("--set 'dist.backend=nccl': dist.backend=nccl")
    # Wrong without the --set settings: the ranks say so, not this check.
    check_settings(["run.id=a"], script, {"HPC_DDP_OVERRIDES": "checkpoint.keep_last=0"})


def test_a_set_after_the_script_is_noted_as_the_scripts_own_argument(
    capsys: pytest.CaptureFixture[str],
) -> None:
    check_settings([], Program("script", "train.py", ("--lr", "1", "--set", "run.id=a")), {})
    assert capsys.readouterr().err.startswith(
        "note: --set after train.py is passed to it as its own argument; hpc-ddp's --set goes "
        "before it"
    )
    check_settings([], Program("script", "train.py", ("--settle", "1")), {})
    assert capsys.readouterr().err == ""


def test_hpc_ddp_locals_nproc_after_the_script_is_noted_before_any_rank_starts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`hpc-ddp local train.py --epochs 1 --nproc 2`: the script's own parser refuses
    --nproc on every rank; the note says first where it goes."""
    missing = str(tmp_path / "train.py")
    assert cli_main(["local", missing, "--epochs", "1", "--nproc=2"]) == 2
    said = capsys.readouterr().err
    assert said.startswith(
        f"note: --nproc after {missing} is passed to it as its own argument; hpc-ddp's --nproc "
        f"goes before it: hpc-ddp local --nproc N {missing} ..."
    ), said


def test_only_a_command_that_starts_a_program_says_where_its_options_go(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for words, hinted in ((["runs", "--bogus"], False), (["local", "--epochs", "3", "x.py"], True)):
        with pytest.raises(SystemExit) as ended:
            cli_main(words)
        assert ended.value.code == 2
        said = capsys.readouterr().err
        assert f"unrecognized arguments: {words[1]}" in said
        assert ("the program's own after it" in said) == hinted, said
    # Each command's own example; a sweep's program goes after --.
    for words, example in (
        (["check-resume", "--epochs", "3", "x.py"], "hpc-ddp check-resume --steps 40 train.py"),
        (["local", "--epochs", "3", "x.py"], "hpc-ddp local --nproc 2 train.py --epochs 3"),
        (["sweep", "submit", "s.yaml", "x.py", "--lr", "1"], "sweep submit sweep.yaml -- train.py"),
    ):
        with pytest.raises(SystemExit):
            cli_main(words)
        said = capsys.readouterr().err
        assert f"{example}" in said, said
    with pytest.raises(SystemExit):
        cli_main(["sweep", "submit", "s.yaml", "--concurency", "2", "--", "x.py"])
    said = capsys.readouterr().err
    assert "unrecognized arguments: --concurency 2" in said, said
    assert "program" not in said, "the program is after -- already"
    assert "HINT: hpc-ddp sweep submit has --concurrency, not --concurency" in said, said


@pytest.mark.parametrize(
    ("words", "hint"),
    [
        (["local", "--nprocs", "2", "x.py"], "hpc-ddp local has --nproc, not --nprocs"),
        (["local", "--nprocs=2", "x.py"], "hpc-ddp local has --nproc, not --nprocs"),
        (["submit", "--nodse=2", "--gpu-per-node=4", "x.py"],
         "hpc-ddp submit has --nodes, not --nodse; --gpus-per-node, not --gpu-per-node"),
        (["local", "--epochs", "3", "x.py"], "hpc-ddp's options go before the program"),
        (["local", "--lrs", "3", "x.py"], "hpc-ddp's options go before the program"),
        (["runs", "--bogus"], None),
    ],
    ids=["spaced", "with-equals", "two-in-one-line", "the-programs-own", "near-an-example-only",
         "nothing-near"],
)  # fmt: skip
def test_a_misspelt_option_is_named_with_the_one_meant(
    words: list[str], hint: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as ended:
        cli_main(words)
    assert ended.value.code == 2
    said = capsys.readouterr().err
    assert f"unrecognized arguments: {words[1]}" in said, said
    if hint is None:
        assert "HINT" not in said, said
    else:
        assert f"HINT: {hint}" in said, said
