"""What a new user meets in the first hour and used to stumble on: `hpc-ddp doctor` on their
own script, the tools piped into `head`, an evaluation's sums logged as they come. Real
processes and real pipes."""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

import hpc_ddp
from hpc_ddp.launch.shipped import CONFIG_DIR, find_config, shipped_config_name, shipped_configs
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.loop.metrics import scalar_metrics
from hpc_ddp.runtime.tracking.base import default_tracking_uri
from hpc_ddp.runtime.tracking.record import current_points, read_metrics
from tests.helpers import REPO, clean_environ

LM = str(REPO / "tests" / "programs" / "lm_loop.py")


def hpc_ddp_cli(*arguments: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpc_ddp", *arguments],
        cwd=cwd,
        env=clean_environ(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.e2e
def test_doctor_checks_a_users_script_with_its_own_arguments_and_settings(tmp_path: Path) -> None:
    result = hpc_ddp_cli(
        "doctor", "--json-dir", str(tmp_path), LM, "--max-iters", "5", "dist.timeout_s=60",
        "run.name=lm",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"[doctor rank 0/1] report: {tmp_path / 'doctor-rank-0.json'}" in result.stdout
    report = json.loads((tmp_path / "doctor-rank-0.json").read_text())
    assert report["ok"] and report["launcher"] == "single" and report["world_size"] == 1
    assert "/lm/" in report["plan"], "the script's run.name setting reached the plan"
    assert not [check for check in report["checks"] if "global batch" in check[1]]


@pytest.mark.e2e
def test_doctor_of_a_script_that_is_not_there_is_one_line(tmp_path: Path) -> None:
    result = hpc_ddp_cli("doctor", "nothere.py", cwd=tmp_path)
    assert result.returncode == 2
    assert "script 'nothere.py' does not exist" in result.stderr and "HINT:" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", [["config"], ["render", "--nodes", "2", LM]])
@pytest.mark.e2e
def test_a_tool_piped_into_head_ends_quietly(command: list[str]) -> None:
    """`hpc-ddp config | head -1`: the reader closes the pipe after its first line."""
    process = subprocess.Popen(
        [sys.executable, "-m", "hpc_ddp", *command],
        cwd=REPO,
        env=clean_environ(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.readline()
    process.stdout.close()
    errors = process.stderr.read().decode()
    assert process.wait(timeout=60) == 0
    assert "Traceback" not in errors and "BrokenPipeError" not in errors, errors


def test_an_evaluations_sums_are_logged_as_their_means() -> None:
    values = scalar_metrics(
        {
            "val_loss": hpc_ddp.Sum(6.0, 4),
            "acc": 0.5,
            "n": torch.tensor(3),
            "none": hpc_ddp.Sum(1.0, 0),
        }
    )
    assert values["val_loss"] == 1.5 and values["acc"] == 0.5 and values["n"] == 3.0
    assert math.isnan(values["none"])
    with pytest.raises(HpcDdpError, match=r"run\.log_metrics got name=str"):
        scalar_metrics({"name": "x"})


@pytest.mark.e2e
def test_the_help_writes_the_output_file_before_the_script() -> None:
    result = hpc_ddp_cli("--help")
    assert "render --nodes 2 --gpus-per-node 4 --time 02:00:00 -o job.sh train.py" in (
        result.stdout
    )


@pytest.mark.e2e
def test_a_rerun_without_a_checkpoint_says_so_and_stays_one_mlflow_run(tmp_path: Path) -> None:
    """The second attempt starts from step 0 and trains 10 steps: the run's record (what
    `hpc-ddp plot` and `runs` draw) keeps its points only, not the first attempt's 20."""
    program = [LM, f"run.output_dir={tmp_path}", "run.id=again"]
    first = hpc_ddp_cli(
        "local", "--nproc", "1", *program, "--max-iters", "20", "checkpoint.enabled=false"
    )
    assert first.returncode == 0, first.stderr[-2000:]
    # An idle-GPU tag the first attempt set while MLflow was away (no GPU here: written as
    # the tracker keeps it): the second attempt's opening of MLflow sends it.
    tracking_file = tmp_path / "lm_loop" / "again" / "tracking.json"
    tracking = json.loads(tracking_file.read_text())
    tracking["tags_set"] = {"hpc_ddp.idle_gpus": "node1 GPU 1 (rank 1)"}
    tracking_file.write_text(json.dumps(tracking))
    second = hpc_ddp_cli("local", "--nproc", "1", *program, "--max-iters", "10")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "ran before but left no checkpoint: it starts again at step 0" in second.stderr
    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path))
    experiment = client.get_experiment_by_name("hpc_ddp")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.tags["hpc_ddp.attempts"] == "2" and run.info.status == "FINISHED"
    assert run.data.tags["hpc_ddp.idle_gpus"] == "node1 GPU 1 (rank 1)"
    run_dir = tmp_path / "lm_loop" / "again"
    written = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(entry.get("step", 0) for entry in written) == 20  # the first attempt's are there
    points = [(entry["step"], name) for entry in read_metrics(run_dir) for name in entry["metrics"]]
    assert max(step for step, _ in points) == 10
    assert len(points) == len(set(points)), "one value per metric and step"
    assert (0, "val_loss") in points and (10, "loss") in points


def test_an_attempt_supersedes_the_points_after_the_step_it_resumed_from() -> None:
    lines = [
        {"attempt": 1, "from_step": 0, "time": 1},
        {"step": 0, "metrics": {"val": 9.0}},
        {"step": 10, "metrics": {"loss": 1.0, "val": 8.0}},
        {"step": 20, "metrics": {"loss": 0.5}},
        {"step": 30, "metrics": {"loss": 0.4}},  # after the checkpoint at 20: lost with it
        {"attempt": 2, "from_step": 20, "time": 2},
        {"step": 20, "metrics": {"val": 7.0}},  # evaluated again at the resumed step
        {"step": 30, "metrics": {"loss": 0.3}},
        "not json",
        {"attempt": 3, "from_step": 0, "time": 3},  # no checkpoint: from the start
        {"step": 10, "metrics": {"loss": 2.0}},
    ]
    text = [line if isinstance(line, str) else json.dumps(line) for line in lines]
    assert [(e["step"], e["metrics"]) for e in current_points(text[:-2])] == [
        (0, {"val": 9.0}),
        (10, {"loss": 1.0, "val": 8.0}),
        (20, {"loss": 0.5}),
        (20, {"val": 7.0}),
        (30, {"loss": 0.3}),
    ]
    assert [(e["step"], e["metrics"]) for e in current_points(text)] == [
        (0, {"val": 9.0}),
        (10, {"loss": 2.0}),
    ]


def readme_script() -> str:
    """The complete script the README shows under "Your own script"."""
    readme = (REPO / "README.md").read_text()
    return readme.split("```python\n# train.py\n", 1)[1].split("```", 1)[0]


@pytest.mark.e2e
def test_the_readmes_script_trains_from_a_project_outside_the_checkout(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(readme_script())
    settings = ["--set", f"run.output_dir={tmp_path / 'runs'}", "--set", "run.id=readme"]
    result = hpc_ddp_cli("local", "--nproc", "2", *settings, "train.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "global batch 128 = 2 rank(s) x 64 per micro-batch" in result.stderr
    assert "HINT" not in result.stderr, "the README's script makes none of the mistakes"
    start = result.stderr.split("global batch", 1)[0].splitlines()
    assert re.search(r"job \S+ \(local\): 2 rank\(s\) on 1 node\(s\), master 127", result.stderr)
    wide = [line for line in start if len(line) > 120 and "run directory" not in line]
    assert not wide, "the start lines fit a terminal without wrapping"
    assert re.search(r"epoch 4 ended: loss 0\.\d+", result.stderr), "the epoch's metrics shown"
    assert re.search(r"step 140: val_accuracy 0\.9\d+", result.stderr), "and the evaluation's"
    run_dir = tmp_path / "runs" / "train" / "readme"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] == 5 * (3584 // 128)
    points = list(read_metrics(run_dir))
    accuracy = [
        point["metrics"]["val_accuracy"] for point in points if "val_accuracy" in point["metrics"]
    ]
    assert len(accuracy) == 5, points[-3:]
    last = accuracy[-1]
    assert last > 0.9, f"the README's model learns its task: {last}"


@pytest.mark.e2e
def test_a_newcomer_installs_from_a_clone_and_runs_the_readme_outside_it(tmp_path: Path) -> None:
    """The first hour, scripted: a clone in a folder named hpc_ddp, installed (not editable)
    into a fresh virtualenv outside it, then `hpc-ddp init` and the README's script in a
    project folder of its own, with nothing of the checkout on the path. The fresh
    environment borrows the suite's installed packages (torch, mlflow) through a .pth file:
    nothing may be downloaded here."""
    clone = tmp_path / "hpc_ddp"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    borrowed = [path for path in sys.path if path.endswith("site-packages")]
    site = next((venv / "lib").glob("python*/site-packages"))
    (site / "borrowed.pth").write_text("\n".join(borrowed) + "\n")
    python = str(venv / "bin" / "python")
    environment = {key: value for key, value in clean_environ().items() if key != "PYTHONPATH"}
    installed = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
         "--no-build-isolation", str(clone)],
        env=environment, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-3000:]
    project = tmp_path / "project"
    project.mkdir()

    def newcomer(*command: str, where: Path = project) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(venv / "bin" / command[0]), *command[1:]],
            cwd=where, env=environment, capture_output=True, text=True, timeout=300,
            check=False,
        )  # fmt: skip

    where = newcomer("python", "-c", "import hpc_ddp; print(hpc_ddp.__file__)")
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr
    init = newcomer("hpc-ddp", "init", "--gpus-per-node", "4")
    assert init.returncode == 0, init.stderr
    job = (project / "train.sh").read_text()
    assert "DEFAULT_ARGS=(train.py)" in job and (project / "logs").is_dir()
    assert f"#SBATCH --output={project / 'logs'}/%x-%j.out" in job
    (project / "train.py").write_text(readme_script())
    trained = newcomer("hpc-ddp", "local", "--nproc", "2", "--set", "run.id=first", "train.py")
    assert trained.returncode == 0, trained.stderr[-3000:]
    summary = json.loads((project / "runs/train/first/summary.json").read_text())
    assert summary["global_step"] == 5 * (3584 // 128) and summary["world_size"] == 2

    # The built-in trainer's shipped configs by name, with no configs/ folder here.
    builtin = newcomer(
        "hpc-ddp", "local", "--nproc", "2", "--config", "digits", "train.epochs=1",
        "run.id=builtin", "tracking.enabled=false",
    )  # fmt: skip
    assert builtin.returncode == 0, builtin.stderr[-3000:]
    builtin_summary = project / "runs/digits-mlp/builtin/summary.json"
    assert json.loads(builtin_summary.read_text())["epochs"] == 1
    # A second project starts from a shipped example; a third from a config to edit.
    starts = {"example": ["--example", "digits_cnn"], "config": ["--config", "digits"]}
    for folder, option in starts.items():
        (project / folder).mkdir()
        made = newcomer("hpc-ddp", "init", *option, where=project / folder)
        assert made.returncode == 0, made.stderr
    shipped = clone / "examples/digits_cnn/train.py"
    assert (project / "example/train.py").read_text() == shipped.read_text()
    assert "DEFAULT_ARGS=(train.py)" in (project / "example/train.sh").read_text()
    config = project / "config/configs/digits.yaml"
    assert config.read_text() == (clone / "configs/digits.yaml").read_text()
    assert "DEFAULT_ARGS=(configs/digits.yaml)" in (project / "config/train.sh").read_text()


SILENT_MISTAKES = """
import torch
import hpc_ddp

run = hpc_ddp.start(run={"name": "mistakes"})
model = run.wrap(torch.nn.Linear(4, 1))
optimizer = torch.optim.AdamW(model.parameters())
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
loader = run.train_loader(data, batch_size=16)
run.register(model=model)  # the optimizer forgotten
for epoch in run.epochs(1):
    for features, target in loader:  # run.steps forgotten
        loss = torch.nn.functional.mse_loss(model(features), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
print("STEPS", run.global_step)
run.finish()
"""


@pytest.mark.e2e
def test_a_forgotten_run_steps_and_optimizer_are_named_with_a_hint(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SILENT_MISTAKES)
    settings = ["--set", f"run.output_dir={tmp_path / 'runs'}", "--set", "tracking.enabled=false"]
    result = hpc_ddp_cli("local", "--nproc", "2", *settings, "train.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "STEPS 0" in result.stdout
    direct = "run.train_loader(...) is iterated directly"
    assert result.stderr.count(direct) == 1, "once, on rank 0"
    assert "HINT: for batch in run.steps(loader):" in result.stderr
    assert "an optimizer (AdamW) steps the registered model but is not registered" in result.stderr
    assert "HINT: run.register(model=model, optimizer=optimizer" in result.stderr


def test_shipped_configs_are_found_by_name_and_a_projects_own_file_wins(tmp_path: Path) -> None:
    assert {"digits", "synthetic"} <= set(shipped_configs())
    assert shipped_config_name("configs/digits.yaml") == shipped_config_name("digits") == "digits"
    assert shipped_config_name("mine/digits.yaml") is None
    assert find_config("configs/digits.yaml", tmp_path) == CONFIG_DIR / "digits.yaml"
    own = tmp_path / "configs" / "digits.yaml"
    own.parent.mkdir()
    own.write_text("train: {epochs: 1}\n")
    assert find_config("configs/digits.yaml", tmp_path) == own
    with pytest.raises(HpcDdpError, match=r"(?s)'nope.yaml' does not exist.*digits, parquet"):
        find_config("nope.yaml", tmp_path)


@pytest.mark.e2e
def test_init_writes_nothing_where_a_file_it_would_write_exists(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('mine')\n")
    result = hpc_ddp_cli("init", "--example", "lm", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "train.py exists already" in result.stderr
    assert (tmp_path / "train.py").read_text() == "print('mine')\n"
    assert not (tmp_path / "train.sh").exists() and not (tmp_path / "logs").exists()


@pytest.mark.e2e
def test_init_writes_nothing_through_a_link_and_says_why_it_cannot_write(tmp_path: Path) -> None:
    """A dangling train.sh or logs link would make its target wherever it points; a logs/
    linked to a folder (scratch space) is used; a logs that is a file is one line."""
    outside = tmp_path / "outside"
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.sh").symlink_to(outside)
    result = hpc_ddp_cli("init", cwd=project)
    assert result.returncode == 2 and "train.sh is a link" in result.stderr, result.stderr
    assert not outside.exists(), "nothing written through the link"
    (project / "train.sh").unlink()
    (project / "logs").write_text("")
    result = hpc_ddp_cli("init", cwd=project)
    assert result.returncode == 2 and "cannot write" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (project / "train.sh").exists()
    (project / "logs").unlink()
    outside.mkdir()
    (project / "logs").symlink_to(outside)
    result = hpc_ddp_cli("init", cwd=project)
    assert result.returncode == 0, result.stderr
    assert (project / "train.sh").is_file() and (project / "logs").resolve() == outside


OWN_PARSER = """
import argparse, os, signal, sys, time
import torch
import hpc_ddp

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
args = parser.parse_args()  # strict: any setting meant for hpc_ddp here would be refused
run = hpc_ddp.start(run={"name": "own"}, preempt={"check_every_steps": 1})
received = []
handler = signal.getsignal(signal.SIGTERM)  # hpc_ddp's: kept, and told of it first
def seen(number, frame):
    received.append(number)
    handler(number, frame)
signal.signal(signal.SIGTERM, seen)
model = run.wrap(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
run.register(model=model, optimizer=optimizer)
for step in run.iterations(args.steps):
    loss = model(torch.ones(2, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if step == 3 and run.resumed is None:
        if run.rank == 0:
            os.kill(os.getppid(), signal.SIGTERM)  # hpc-ddp local passes it to every rank
        deadline = time.monotonic() + 120
        while not received:  # each rank holds its step until the signal reached it
            if time.monotonic() > deadline:
                sys.exit("SIGTERM did not come back from hpc-ddp local within 120 s")
            time.sleep(0.01)
print("DONE", run.global_step)
run.finish()
"""


@pytest.mark.e2e
def test_a_stopped_runs_hint_is_the_exact_command_that_continues_it(tmp_path: Path) -> None:
    """A script with its own strict argument parser and no run.id: the stop message names
    an `hpc-ddp local` command that, typed as printed, resumes the run where it stopped."""
    (tmp_path / "train.py").write_text(OWN_PARSER)
    settings = ["--set", f"run.output_dir={tmp_path / 'runs'}", "--set", "tracking.enabled=false"]
    program = ["train.py", "--steps", "40"]
    stopped = hpc_ddp_cli("local", "--nproc", "2", *settings, *program, cwd=tmp_path)
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    hint = re.search(r"to continue: (hpc-ddp local .*)", stopped.stderr)
    assert hint is not None, stopped.stderr[-3000:]
    command = shlex.split(hint.group(1))
    assert command[-3:] == program, command
    resumed = hpc_ddp_cli(*command[1:], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "DONE 40" in resumed.stdout
    run_id = next(word for word in command if word.startswith("run.id=")).split("=", 1)[1]
    summary = json.loads((tmp_path / "runs" / "own" / run_id / "summary.json").read_text())
    assert summary["global_step"] == 40 and summary["resumed_from_step"] > 3, summary


PLAIN_OWN_PARSER = """
import argparse
import torch
import hpc_ddp

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
args = parser.parse_args()  # strict: run.id=... appended to the command would be refused
run = hpc_ddp.start(run={"name": "own"})
model = run.wrap(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
run.register(model=model, optimizer=optimizer)
for step in run.iterations(args.steps):
    model(torch.ones(2, 4)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
print("DONE", run.global_step)
run.finish()
"""


@pytest.mark.e2e
def test_a_plain_python_runs_stop_hint_is_the_exact_command_that_continues_it(
    tmp_path: Path,
) -> None:
    """Plain `python` and a strict parser: the hint is the process's own command with the id
    added to the settings already in $HPC_DDP_OVERRIDES, and typed as printed it resumes."""
    (tmp_path / "train.py").write_text(PLAIN_OWN_PARSER)
    given = f"run.output_dir={tmp_path / 'runs'} tracking.enabled=false preempt.stop_at_step=5"
    environ = {**clean_environ(), "HPC_DDP_OVERRIDES": given}
    stopped = subprocess.run([sys.executable, "train.py", "--steps", "12"], cwd=tmp_path,
                             env=environ, capture_output=True, text=True, timeout=180,
                             check=False)  # fmt: skip
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    hint = re.search(r"to continue: (HPC_DDP_OVERRIDES=.*)", stopped.stderr)
    assert hint is not None, stopped.stderr[-3000:]
    variable, *command = shlex.split(hint.group(1))
    assert command == [sys.executable, "train.py", "--steps", "12"], command
    overrides = shlex.split(variable.removeprefix("HPC_DDP_OVERRIDES="))
    assert overrides[:-1] == shlex.split(given) and overrides[-1].startswith("run.id=single-")
    resumed = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=180,
                             env={**clean_environ(), "HPC_DDP_OVERRIDES": shlex.join(overrides)},
                             check=False)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "DONE 12" in resumed.stdout
    run_id = overrides[-1].removeprefix("run.id=")
    summary = json.loads((tmp_path / "runs" / "own" / run_id / "summary.json").read_text())
    assert (summary["global_step"], summary["resumed_from_step"]) == (12, 5), summary


@pytest.mark.e2e
def test_settings_from_the_environment_reach_the_built_in_trainer(tmp_path: Path) -> None:
    """`hpc-ddp local --set` carries settings in $HPC_DDP_OVERRIDES: the built-in trainer's
    own sections were refused there ("unknown section 'train'") and a dry run ignored them."""
    settings = ["--set", "train.epochs=1", "--set", "tracking.enabled=false", "--set", "run.id=s"]
    trained = hpc_ddp_cli("local", "--nproc", "2", *settings, "--config", "digits", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    summary = json.loads((tmp_path / "runs/digits-mlp/s/summary.json").read_text())
    assert summary["epochs"] == 1 and summary["world_size"] == 2
    environment = {**clean_environ(), "HPC_DDP_OVERRIDES": "run.id=fromenv data.batch_size=32"}
    planned = subprocess.run(
        [sys.executable, "-m", "hpc_ddp.train", "--config", "digits", "--dry-run",
         "data.batch_size=16"],
        cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr[-3000:]
    report = json.loads(planned.stdout)
    assert "runs/digits-mlp/fromenv" in report["plan"], report["plan"]
    assert report["per_rank_batch"] == 16, "the command line wins over the environment"


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        (["argv.py", "--", "--lr", "3"], ["argv.py", "--", "--lr", "3"]),  # as python keeps it
        (["--", "argv.py", "--lr", "3"], ["argv.py", "--lr", "3"]),  # hpc-ddp's own end
        (["argv.py", "--lr", "3", "--", "x"], ["argv.py", "--lr", "3", "--", "x"]),
    ],
)
@pytest.mark.e2e
def test_a_double_dash_after_the_script_reaches_it(
    tmp_path: Path, command: list[str], argv: list[str]
) -> None:
    (tmp_path / "argv.py").write_text("import sys\nprint('ARGV', sys.argv)\n")
    result = hpc_ddp_cli("local", "--nproc", "1", *command, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"ARGV {argv}" in result.stdout, result.stdout


@pytest.mark.e2e
def test_a_bad_setting_in_the_script_is_said_once_not_once_a_rank(tmp_path: Path) -> None:
    """Every rank reads the same settings and fails alike: the host's first rank says it. A
    rank that waited past the limit for it says it too, saying why (the machine's pace
    decides whether any did, so only the plain copies are counted)."""
    script = tmp_path / "train.py"
    script.write_text(
        "import hpc_ddp\n"
        'run = hpc_ddp.start(tracking={"enabled": False}, checkpoint={"every_steps": -3})\n'
    )
    result = hpc_ddp_cli("local", "--nproc", "3", str(script), cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    said = "checkpoint.every_steps=-3 is invalid: expected > 0"
    plain = re.findall(rf"^\[rank (\d+)\] error: .*{re.escape(said)}", result.stderr, re.M)
    late = re.findall(rf"^\[rank \d+\] error \(its host's first rank .*{re.escape(said)}",
                      result.stderr, re.M)  # fmt: skip
    assert plain in (["0"], []) and (plain or late), result.stderr
