"""`hpc-ddp render`: golden files, hostile paths kept inert, and unsafe values refused."""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.launch.program import program_from
from hpc_ddp.launch.sbatch import RenderRequest, render_sbatch, template_path
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.place.slurm import time_to_minutes
from tests.helpers import REPO, clean_environ

GOLDEN = REPO / "tests" / "golden"
HOSTILE_CONFIG = "configs/my runs/it's; echo PWNED.yaml"
HOSTILE_SCRIPT = "my runs/train it's.py"
HOSTILE_SCRIPT_ARGS = ["--lr", "3e-4", "--note", "$(touch PWNED); echo `touch PWNED2`"]
HOSTILE_OVERRIDES = [
    "run.name=$(touch PWNED)",
    "run.output_dir=`touch PWNED2`",
    'tracking.experiment="x y"',
]

CASES = {
    "gpu-2nodes.sh": [
        "--config",
        "configs/digits.yaml",
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--time",
        "02:00:00",
        "--partition",
        "gpu",
        "--job-name",
        "digits",
        "train.epochs=5",
    ],
    "cpu-hostile.sh": [
        "--config",
        HOSTILE_CONFIG,
        "--nodes",
        "1",
        "--tasks-per-node",
        "3",
        "--cpus-per-task",
        "2",
        "--time",
        "30",
        *HOSTILE_OVERRIDES,
    ],
    "script-2nodes.sh": [
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--time",
        "02:00:00",
        HOSTILE_SCRIPT,
        *HOSTILE_SCRIPT_ARGS,
    ],
    "torchrun-2nodes.sh": [
        "--launcher",
        "torchrun",
        "--config",
        "configs/synthetic.yaml",
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--time",
        "1-00:00:00",
    ],
}


@pytest.fixture()
def workdir(tmp_path: Path) -> Path:
    """A submission directory holding the configs, the hostile one included."""
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    hostile = tmp_path / HOSTILE_CONFIG
    hostile.parent.mkdir(parents=True)
    shutil.copy(REPO / "configs" / "synthetic.yaml", hostile)
    script = tmp_path / HOSTILE_SCRIPT
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text("print('a user script')\n")
    return tmp_path


def render(workdir: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpc_ddp", "render", *args],
        cwd=workdir,
        env=clean_environ(),
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.parametrize("golden", sorted(CASES))
@pytest.mark.e2e
def test_render_matches_golden_file(golden: str, workdir: Path) -> None:
    result = render(workdir, CASES[golden])
    assert result.returncode == 0, result.stderr
    assert (workdir / "logs").is_dir(), "render creates the job's log folder"
    # The log folder and the folder the job works in are written absolutely, and so is the
    # python: they vary from run to run.
    rendered = result.stdout.replace(str(workdir), "/the/folder/it/was/rendered/in")
    rendered = rendered.replace(sys.executable, "/the/python/that/rendered/it")
    path = GOLDEN / golden
    if os.environ.get("HPC_DDP_UPDATE_GOLDEN") == "1":
        path.write_text(rendered)
    expected = path.read_text()
    if rendered != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(True), rendered.splitlines(True), str(path), "rendered"
            )
        )
        pytest.fail(
            f"{golden} differs from the rendered script:\n{diff}\nIf the change is intended, "
            "accept it with: HPC_DDP_UPDATE_GOLDEN=1 make test PYTEST_ARGS=tests/test_render.py"
        )


@pytest.mark.e2e
def test_rendered_scripts_are_valid_bash() -> None:
    for path in [
        *GOLDEN.glob("*.sh"),
        REPO / "slurm" / "train.sh",
        REPO / "slurm" / "train-torchrun.sh",
    ]:
        subprocess.run(["bash", "-n", str(path)], check=True)


def fake_slurm_bin(directory: Path) -> Path:
    """`srun` that records its argv as JSON and runs nothing: Slurm itself is not needed here."""
    directory.mkdir()
    srun = directory / "srun"
    srun.write_text(
        "#!/usr/bin/env python3\nimport json, sys, os\n"
        "open(os.environ['ARGV_LOG'], 'w').write(json.dumps(sys.argv[1:]))\n"
        "open(os.environ['ARGV_LOG'] + '.cwd', 'w').write(os.getcwd())\n"
    )
    srun.chmod(0o755)
    return directory


#: What srun starts python with (coreutils here is 8.31 or later): the stop signals blocked
#: until the rank's first line holds them.
BLOCKED_UNTIL_HELD = ["env", "--block-signal=USR1,USR2,TERM,HUP,ALRM"]


def srun_argv(
    script: Path, workdir: Path, arguments: tuple[str, ...] = (), submitted_from: Path | None = None
) -> list[str]:
    """Run a rendered job script with a fake srun, from ``submitted_from`` (else ``workdir``);
    return the argv srun was given, without ``--label`` and the ``env --block-signal`` that
    starts python (both checked here). srun's working folder is left in argv.json.cwd."""
    bin_dir = workdir / "fakebin"
    if not bin_dir.is_dir():
        fake_slurm_bin(bin_dir)
    argv_log = workdir / "argv.json"
    environment = clean_environ(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        ARGV_LOG=str(argv_log),
        SLURM_JOB_ID="1",
        SLURM_JOB_NODELIST="node1",
    )
    subprocess.run(
        ["bash", str(script), *arguments],
        cwd=submitted_from or workdir,
        env=environment,
        check=True,
        capture_output=True,
    )
    argv: list[str] = json.loads(argv_log.read_text())
    assert argv[:2] == ["--kill-on-bad-exit=1", "--label"], argv
    assert argv[2:4] == BLOCKED_UNTIL_HELD, argv
    return [argv[0], *argv[4:]]


@pytest.mark.e2e
def test_hostile_paths_reach_python_verbatim_and_run_nothing(workdir: Path) -> None:
    script = workdir / "job.sh"
    result = render(workdir, [*CASES["cpu-hostile.sh"], "--output", str(script)])
    assert result.returncode == 0, result.stderr
    argv = srun_argv(script, workdir)
    assert argv[:4] == ["--kill-on-bad-exit=1", sys.executable, "-m", "hpc_ddp.train"]
    assert argv[4:] == ["--config", HOSTILE_CONFIG, *HOSTILE_OVERRIDES]
    assert not (workdir / "PWNED").exists() and not (workdir / "PWNED2").exists()
    assert not list(workdir.glob("*PWNED*"))


@pytest.mark.e2e
def test_a_users_script_and_its_arguments_reach_every_rank_verbatim(workdir: Path) -> None:
    """`hpc-ddp render ... train.py args`: srun starts `python -m hpc_ddp run` with the script
    and its arguments exactly as given (spaces, quotes and `$(...)` stay inert)."""
    script = workdir / "job.sh"
    # Everything after the script is the script's: hpc-ddp's own options come first.
    result = render(workdir, ["--output", str(script), *CASES["script-2nodes.sh"]])
    assert result.returncode == 0, result.stderr
    argv = srun_argv(script, workdir)
    assert argv == [
        "--kill-on-bad-exit=1",
        sys.executable,
        "-m",
        "hpc_ddp",
        "run",
        HOSTILE_SCRIPT,
        *HOSTILE_SCRIPT_ARGS,
    ]
    assert not list(workdir.glob("*PWNED*"))
    elsewhere = workdir / "elsewhere"
    elsewhere.mkdir()
    assert srun_argv(script, workdir, submitted_from=elsewhere) == argv
    assert (workdir / "argv.json.cwd").read_text() == str(workdir), (
        "the job works in the folder it was rendered in, wherever it is submitted from"
    )
    assert srun_argv(script, workdir, ("-m", "mypkg.train", "--epochs", "2"))[2:] == [
        "-m",
        "hpc_ddp",
        "run",
        "-m",
        "mypkg.train",
        "--epochs",
        "2",
    ]


@pytest.mark.e2e
def test_a_hostile_folder_and_a_site_file_keep_the_job_in_its_folder_and_python(
    tmp_path: Path,
) -> None:
    """Rendered in a folder whose name holds shell syntax, the job works there and runs
    nothing of the name; the python is the rendering one, unless slurm/site.sh (which may
    activate an environment) was sourced: then the PATH's, as the template has it."""
    project = tmp_path / "we}ird $(touch PWNED) 'q\""
    project.mkdir()
    (project / "train.py").write_text("print('a user script')\n")
    script = project / "job.sh"
    # Slurm reads the log's folder from an #SBATCH line: that one must be a plain path.
    logs = ["--log-dir", str(tmp_path / "logs")]
    result = render(project, [*logs, "-o", "job.sh", "train.py", "--lr", "1"])
    assert result.returncode == 0, result.stderr
    assert "#   sbatch job.sh " in script.read_text()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    argv = srun_argv(script, project, submitted_from=elsewhere)
    assert (project / "argv.json.cwd").read_text() == str(project)
    assert argv[1:] == [sys.executable, "-m", "hpc_ddp", "run", "train.py", "--lr", "1"]
    assert not list(tmp_path.rglob("PWNED*"))
    (project / "slurm").mkdir()
    (project / "slurm" / "site.sh").write_text("# activates the project's environment\n")
    assert srun_argv(script, project, submitted_from=elsewhere)[1] == "python"


@pytest.mark.e2e
def test_an_output_name_that_would_break_out_of_the_header_is_refused(workdir: Path) -> None:
    result = render(workdir, ["-o", "x\ntouch PWNED #.sh", *CASES["gpu-2nodes.sh"]])
    assert result.returncode == 2
    assert "script name" in result.stderr and "line break" in result.stderr
    assert not list(workdir.glob("*PWNED*"))


@pytest.mark.e2e
def test_a_rendered_script_whose_folder_moved_stops_saying_so(
    workdir: Path, tmp_path: Path
) -> None:
    """The job works in the folder it was rendered in: moved away, it stops with the fix
    instead of starting the ranks elsewhere."""
    script = workdir / "job.sh"
    assert render(workdir, ["--output", str(script), *CASES["script-2nodes.sh"]]).returncode == 0
    moved = tmp_path.parent / f"{tmp_path.name}-moved"
    script.rename(tmp_path.parent / f"{tmp_path.name}-job.sh")
    workdir.rename(moved)
    moved.joinpath("elsewhere").mkdir()
    result = subprocess.run(
        ["bash", str(tmp_path.parent / f"{tmp_path.name}-job.sh")],
        cwd=moved / "elsewhere", env=clean_environ(SLURM_JOB_ID="1"), capture_output=True,
        text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert f"error: cannot work in {workdir}, the folder this script was written in" in (
        result.stderr
    )
    assert "HINT: write it again with hpc-ddp render" in result.stderr


@pytest.mark.e2e
def test_render_refuses_a_script_that_does_not_exist(workdir: Path) -> None:
    result = render(workdir, ["--nodes", "2", "missing.py", "--lr", "1"])
    assert result.returncode == 2
    assert "script 'missing.py' does not exist" in result.stderr and "HINT:" in result.stderr
    assert "Traceback" not in result.stderr
    result = render(workdir, ["-o", str(workdir / "no" / "such" / "job.sh")])
    assert result.returncode == 2 and "the directory" in result.stderr


def test_the_templates_ship_with_the_package_and_slurm_links_to_them() -> None:
    for launcher, name in (("srun", "train.sh"), ("torchrun", "train-torchrun.sh")):
        installed = template_path(launcher)
        assert installed.is_file() and "hpc_ddp/launch/templates" in str(installed)
        assert (REPO / "slurm" / name).resolve() == installed.resolve()


@pytest.mark.e2e
def test_command_line_arguments_replace_the_rendered_defaults(workdir: Path) -> None:
    script = workdir / "job.sh"
    assert render(workdir, [*CASES["gpu-2nodes.sh"], "-o", str(script)]).returncode == 0
    assert srun_argv(script, workdir, ("train.epochs=9",))[4:] == [
        "--config",
        "configs/digits.yaml",
        "train.epochs=5",
        "train.epochs=9",
    ]
    assert srun_argv(script, workdir, ("configs/synthetic.yaml", "train.epochs=2"))[4:] == [
        "--config",
        "configs/synthetic.yaml",
        "train.epochs=2",
    ]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("job_name", "x\n#SBATCH --uid=0", "not accepted in an #SBATCH line"),
        ("partition", "gpu; rm -rf /", "not accepted in an #SBATCH line"),
        ("time", "1:00:00\n#SBATCH --x", "not accepted in an #SBATCH line"),
        ("arguments", ("configs/a\nrm -rf ~",), "contains a line break"),
    ],
)
def test_unsafe_values_are_refused(field: str, value: object, message: str) -> None:
    template = template_path().read_text()
    request = RenderRequest(**{"arguments": ("configs/digits.yaml",), field: value})  # type: ignore[arg-type]
    with pytest.raises(HpcDdpError, match=message):
        render_sbatch(template, request)


def test_template_drift_is_detected() -> None:
    template = template_path().read_text().replace("#SBATCH --nodes=1\n", "")
    with pytest.raises(HpcDdpError, match="0 '#SBATCH --nodes=' lines"):
        render_sbatch(template, RenderRequest(arguments=("c.yaml",)))


def test_the_template_gives_every_task_all_the_gpus_of_its_node() -> None:
    """One task per GPU, the GPUs requested per node (not per task), so each task sees the
    node's GPUs and NCCL can use CUDA IPC between them; the two counts agree."""
    text = template_path().read_text()
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    tasks = [line.split("=", 1)[1] for line in directives if "--ntasks-per-node=" in line]
    gpus = [line.split("=", 1)[1] for line in directives if "--gpus-per-node=" in line]
    assert tasks == gpus == ["2"]
    assert not any("gpus-per-task" in line or "--gres" in line for line in directives)
    assert "--nnodes" not in text and "$SLURM_NNODES" not in text
    rendered = render_sbatch(text, RenderRequest(arguments=("c.yaml",), nodes=3, gpus_per_node=8))
    lines = rendered.splitlines()
    assert "#SBATCH --ntasks-per-node=8" in lines and "#SBATCH --gpus-per-node=8" in lines
    assert "#SBATCH --nodes=3" in lines
    cpu = render_sbatch(
        text, RenderRequest(arguments=("c.yaml",), gpus_per_node=0, cpu_tasks_per_node=4)
    )
    assert "#SBATCH --ntasks-per-node=4" in cpu.splitlines()
    assert "(--gpus-per-node not requested)" in cpu and "#SBATCH --gpus" not in cpu


@pytest.mark.parametrize(
    ("text", "minutes"),
    [
        ("90", 90),
        ("1:00:00", 60),
        ("00:30:01", 31),
        ("2-00", 2880),
        ("1-02:03", 1563),
        ("1-00:00:00", 1440),
        ("5:30", 6),
    ],
)
def test_time_to_minutes(text: str, minutes: int) -> None:
    assert time_to_minutes(text) == minutes


def test_bad_time_is_refused() -> None:
    with pytest.raises(HpcDdpError, match="not a Slurm time"):
        time_to_minutes("one hour")


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (
            ["render", "--cpus-per-task", "-3", "train.py"],
            "--cpus-per-task: -3 is too small: at least 1",
        ),
        (["submit", "--nodes", "0", "train.py"], "--nodes: 0 is too small: at least 1"),
        (["submit", "--tasks-per-node", "0", "train.py"], "--tasks-per-node: 0 is too small"),
        (["local", "--nproc", "0", "train.py"], "--nproc: 0 is too small: at least 1"),
        (["data", "make", "--rows", "10", "--features", "0", "--out", "x"], "--features: 0"),
        (["data", "make", "--rows", "10", "--classes", "1", "--out", "x"], "at least 2"),
        (["render", "--nodes", "two", "train.py"], "--nodes: 'two' is not a whole number"),
    ],
)
def test_counts_that_cannot_be_are_usage_errors(
    command: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from hpc_ddp.cli import main

    with pytest.raises(SystemExit) as exited:
        main(command)
    assert exited.value.code == 2
    assert expected in capsys.readouterr().err


def test_the_cli_says_its_version_and_names_no_internals(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from importlib.metadata import version

    from hpc_ddp.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out == f"hpc-ddp {version('hpc_ddp')}\n"
    with pytest.raises(SystemExit):
        main(["data"])
    error = capsys.readouterr().err
    assert "required: COMMAND" in error and "data_command" not in error
    with pytest.raises(SystemExit):
        main(["port", "--help"])
    assert "Print this job's rendezvous port." in capsys.readouterr().out


@pytest.mark.e2e
def test_data_make_under_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    result = subprocess.run(
        [sys.executable, "-m", "hpc_ddp", "data", "make", "--rows", "10",
         "--out", str(tmp_path / "file" / "data")],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "cannot create" in result.stderr and "HINT: pass --out a directory" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.e2e
def test_the_warning_signal_is_rendered_from_the_config(workdir: Path) -> None:
    result = render(workdir, ["--config", "configs/digits.yaml", "preempt.signal=USR2"])
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --signal=USR2@120\n" in result.stdout
    assert "export HPC_DDP_JOB_SIGNAL=${HPC_DDP_JOB_SIGNAL:-USR2}\n" in result.stdout
    assert "USR1@" not in result.stdout
    (workdir / "train.py").write_text("print(1)\n")
    script = render(workdir, ["--signal", "URG", "train.py"])
    assert "#SBATCH --signal=URG@120\n" in script.stdout, script.stderr
    default = render(workdir, ["train.py"])
    assert "#SBATCH --signal=USR1@120\n" in default.stdout, default.stderr


@pytest.mark.e2e
def test_a_signal_the_config_does_not_handle_is_refused(workdir: Path) -> None:
    arguments = ["--signal", "USR1", "--config", "configs/digits.yaml", "preempt.signal=USR2"]
    result = render(workdir, arguments)
    assert result.returncode == 2
    assert "--signal USR1 but the config's preempt.signal is USR2" in result.stderr
    assert "HINT: drop --signal" in result.stderr and "Traceback" not in result.stderr


TRAINER = ["-m", "hpc_ddp.train", "--config"]


@pytest.mark.parametrize(
    ("arguments", "program"),
    [
        (["train.py", "--lr", "a b"], ["-m", "hpc_ddp", "run", "train.py", "--lr", "a b"]),
        (["train.epochs=2"], [*TRAINER, "configs/digits.yaml", "train.epochs=2"]),
        ([], [*TRAINER, "configs/digits.yaml"]),
        (["-m", "pkg.train"], ["-m", "hpc_ddp", "run", "-m", "pkg.train"]),
    ],
)
@pytest.mark.e2e
def test_the_body_both_templates_share_picks_the_program(
    arguments: list[str], program: list[str], tmp_path: Path
) -> None:
    """job-body.sh, found as the templates find it, sourced by bash with a job's arguments."""
    script = (
        "DEFAULT_ARGS=(configs/digits.yaml); HPC_DDP_LOG_DIR=/scratch/logs; SLURM_JOB_ID=7\n"
        'source "$("$PYTHON" -m hpc_ddp.launch.templates)"\n'
        'printf "%s\\n" "${program[@]}"; echo "$TORCH_FR_DUMP_TEMP_FILE"\n'
    )
    result = subprocess.run(
        ["bash", "-c", script, "job", *arguments],
        cwd=tmp_path,
        env=clean_environ(PYTHON=sys.executable),
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    *chosen, trace = result.stdout.splitlines()
    assert chosen == program
    assert trace == "/scratch/logs/nccl-trace-7-rank-"


@pytest.mark.parametrize(
    ("first", "is_program"),
    [
        ("lr=0.1.py", True),  # files whose names hold '='
        ("exp=1/train", True),
        ("pkgdir", True),  # a folder with __main__.py: python runs it
        ("train.epochs=2", False),
        ("data.batch_size=64", False),
    ],
)
@pytest.mark.e2e
def test_one_rule_tells_a_program_from_a_setting_in_every_launcher(
    first: str, is_program: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hpc-ddp's reading and the job templates' agree, on real files in the folder."""
    (tmp_path / "lr=0.1.py").write_text("print(1)\n")
    (tmp_path / "exp=1").mkdir()
    (tmp_path / "exp=1" / "train").write_text("print(1)\n")
    (tmp_path / "pkgdir").mkdir()
    (tmp_path / "pkgdir" / "__main__.py").write_text("print(1)\n")
    monkeypatch.chdir(tmp_path)
    program = program_from([first], default_config="configs/digits.yaml")
    assert (program.kind == "script") == is_program, program
    if is_program:
        program.check()  # exists, runnable
    script = (
        "DEFAULT_ARGS=(configs/digits.yaml); HPC_DDP_LOG_DIR=/scratch/logs\n"
        'source "$("$PYTHON" -m hpc_ddp.launch.templates)"\n'
        'printf "%s\\n" "${program[@]}"\n'
    )
    result = subprocess.run(
        ["bash", "-c", script, "job", first],
        cwd=tmp_path, env=clean_environ(PYTHON=sys.executable), capture_output=True, text=True,
        check=False,
    )  # fmt: skip
    chosen = result.stdout.splitlines()
    trainer = [*TRAINER, "configs/digits.yaml", first]
    assert chosen == (["-m", "hpc_ddp", "run", first] if is_program else trainer), result.stderr


@pytest.mark.parametrize("template", ["train.sh", "train-torchrun.sh"])
def test_the_checked_in_templates_log_where_sbatch_is_called(template: str) -> None:
    """Slurm never creates the log's folder, and a missing one fails the job with no log at
    all: `sbatch slurm/train.sh` from a project without logs/ must still leave one."""
    text = (REPO / "slurm" / template).read_text()
    logs = re.findall(r"^#SBATCH --(?:output|error)=(.*)$", text, flags=re.MULTILINE)
    assert logs == ["%x-%j.out", "%x-%j.out"]
    assert "HPC_DDP_LOG_DIR=${HPC_DDP_LOG_DIR:-$PWD}" in text
    rendered = render_sbatch(text, RenderRequest(arguments=("c.yaml",), log_dir="/scratch/x"))
    assert "#SBATCH --output=/scratch/x/%x-%j.out" in rendered
    assert "HPC_DDP_LOG_DIR=${HPC_DDP_LOG_DIR:-/scratch/x}" in rendered


def test_a_log_folder_that_cannot_be_placed_is_refused() -> None:
    text = (REPO / "slurm" / "train.sh").read_text()
    with pytest.raises(HpcDdpError, match="--log-dir is empty"):
        render_sbatch(text, RenderRequest(arguments=("c.yaml",), log_dir=" "))
    moved = text.replace("#SBATCH --output=%x", "#SBATCH --output=logs/%x")
    moved = moved.replace("#SBATCH --error=%x", "#SBATCH --error=logs/%x")
    with pytest.raises(HpcDdpError, match=r"no '#SBATCH --output=%x\.\.\.' line"):
        render_sbatch(moved, RenderRequest(arguments=("c.yaml",), log_dir="/scratch/x"))


def test_a_module_is_looked_for_as_python_m_does_from_the_launch_directory(
    tmp_path: Path,
) -> None:
    """A package of the project, not installed, is found from the directory the job starts
    in (the ranks' `python -m` looks there first); a package without __main__ is refused."""
    from hpc_ddp.launch.program import check_module_runs

    project = tmp_path / "project"
    (project / "mylab").mkdir(parents=True)
    (project / "mylab" / "__init__.py").write_text("")
    (project / "mylab" / "train.py").write_text("")
    with pytest.raises(HpcDdpError, match="'mylab' is a package without a __main__ module"):
        check_module_runs("mylab", project)
    assert "mylab" not in sys.modules, "its __init__ is not run to look for __main__"
    check_module_runs("mylab.train", project)
    (project / "mylab" / "__main__.py").write_text("")
    check_module_runs("mylab", project)
    with pytest.raises(HpcDdpError, match=r"'otherlab.train' cannot be found .* from "):
        check_module_runs("otherlab.train", tmp_path)
    assert str(project) not in sys.path
    sys.modules.pop("mylab", None)  # found as python -m finds it: imported


@pytest.mark.e2e
def test_a_snapshot_copies_the_checkouts_code_as_it_is_on_disk_and_the_job_runs_it(
    tmp_path: Path,
) -> None:
    """render --snapshot in a git checkout: tracked files with their uncommitted changes and
    untracked ones are copied, git-ignored ones are not; the copy says which commit it came
    from, and the job script runs the copy's script."""
    from tests.test_user_script import commit_all

    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "model.py").write_text("WIDTH = 8\n")
    (project / ".gitignore").write_text("data/\n")
    commit = commit_all(project)
    (project / "model.py").write_text("WIDTH = 16\n")  # uncommitted
    (project / "train.py").write_text("import model\n")  # untracked
    (project / "data" / "big.bin").write_text("data\n")  # ignored
    rendered = subprocess.run(
        [sys.executable, "-m", "hpc_ddp", "render", "--snapshot", "-o", "job.sh", "train.py",
         "--lr", "1"],
        cwd=project, env=clean_environ(), capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    (copy,) = (project / "logs" / "snapshots").iterdir()
    assert f"copied the code into {copy}: every attempt of the job runs that copy" in (
        rendered.stderr
    )
    files = sorted(str(path.relative_to(copy)) for path in copy.rglob("*") if path.is_file())
    assert files == [".gitignore", "hpc-ddp-snapshot.json", "model.py", "train.py"]
    assert (copy / "model.py").read_text() == "WIDTH = 16\n"
    source = json.loads((copy / "hpc-ddp-snapshot.json").read_text())
    assert (source["source"], source["git_commit"], source["git_dirty"]) == (
        str(project),
        commit,
        True,
    )
    assert f"DEFAULT_ARGS=({copy / 'train.py'} --lr 1)" in (project / "job.sh").read_text()

    module = subprocess.run(
        [sys.executable, "-m", "hpc_ddp", "render", "--snapshot", "-m", "json.tool"],
        cwd=project, env=clean_environ(), capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert module.returncode == 2
    assert "--snapshot copies a script's code, and this job runs -m json.tool" in module.stderr
    assert "HINT: start your code as a script" in module.stderr
