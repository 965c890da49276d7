"""A user's own training script (tests/programs/regression.py: dict batches, a regression
loss, its own scheduler and state) on real local gloo ranks through `hpc-ddp local`, plain
`python`, `-m` and submitit's local executor; the Slurm side is in test_slurm_user_script.py."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from mlflow import MlflowClient

import hpc_ddp
from hpc_ddp.runtime.checkpoint.export import model_weights
from hpc_ddp.runtime.checkpoint.files import list_checkpoints, load_checkpoint
from hpc_ddp.runtime.errors import EXIT_STOPPED, HpcDdpError
from hpc_ddp.runtime.loop.data import TrainLoader
from hpc_ddp.runtime.loop.streams import move_to
from hpc_ddp.runtime.monitor.account import PARTS
from hpc_ddp.runtime.preempt.progress import read_attempts
from hpc_ddp.runtime.preempt.requeue import JOB_SIGNAL_VARIABLE, check_job_signal
from hpc_ddp.runtime.tracking.base import default_tracking_uri
from hpc_ddp.view.plot import curves
from hpc_ddp.view.runs import load_run
from tests.helpers import (
    REPO,
    clean_environ,
    read_summary,
    run_local_program,
    run_python,
    signal_after,
    start_program,
)
from tests.programs import regression

PROGRAM = str(REPO / "tests" / "programs" / "regression.py")
FAULTS = str(REPO / "tests" / "programs" / "faults.py")
TEARDOWN = str(REPO / "tests" / "programs" / "teardown.py")


def result_of(output: str) -> dict[str, Any]:
    """The RESULT line rank 0 of regression.py prints."""
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, output[-2000:]
    return json.loads(lines[0].removeprefix("RESULT "))  # type: ignore[no-any-return]


def final_weights(output_dir: Path, run_id: str) -> dict[str, torch.Tensor]:
    newest = list_checkpoints(output_dir / "regression" / run_id / "checkpoints")[0]
    objects = load_checkpoint(newest)["objects"]
    assert set(objects.kinds) == {"model", "optimizer", "scheduler", "best"}
    assert objects.kinds["optimizer"] == "optimizer", "saved as tensors, by parameter name"
    return model_weights(newest, "model")[1]


@pytest.fixture(scope="module")
def world_sizes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """The same global batch of 96 at world sizes 1, 2 and 3, and at 2 with accumulation."""
    runs = {"w1": (1, []), "w2": (2, []), "w3": (3, []), "w2_accum2": (2, ["--accum", "2"])}
    outputs = {}
    for name, (nproc, extra) in runs.items():
        output = tmp_path_factory.mktemp(name)
        program = [PROGRAM, "--epochs", "2", *extra, f"run.output_dir={output}", "run.id=x"]
        result = run_local_program(nproc, [*program, "tracking.enabled=false"])
        assert result.returncode == 0, result.stderr[-3000:]
        outputs[name] = (output, result_of(result.stdout))
    return outputs


@pytest.mark.e2e
def test_a_users_script_trains_to_the_same_weights_at_every_world_size(world_sizes) -> None:
    reference = final_weights(world_sizes["w1"][0], "x")
    for name in ("w2", "w3", "w2_accum2"):
        other = final_weights(world_sizes[name][0], "x")
        for key in reference:
            torch.testing.assert_close(other[key], reference[key], rtol=1e-5, atol=1e-6)
    untrained = torch.nn.Linear(8, 32)
    assert reference["0.weight"].shape == untrained.weight.shape
    assert [
        read_summary(world_sizes[n][0], "regression", "x")["world_size"] for n in ("w1", "w2", "w3")
    ] == [1, 2, 3]


@pytest.mark.e2e
def test_its_evaluation_counts_every_sample_once_and_is_exact(world_sizes) -> None:
    results = {name: result for name, (_output, result) in world_sizes.items()}
    initial = {results[name]["initial_val_mse"] for name in ("w1", "w2", "w3", "w2_accum2")}
    assert len(initial) == 1, f"the same weights must give the same metric exactly: {initial}"
    assert {result["val_count"] for result in results.values()} == {1001}
    assert {result["global_step"] for result in results.values()} == {100}
    trained = results["w1"]["val_mse"]
    assert trained < initial.pop() / 5, "the loss fell"
    for name in ("w2", "w3", "w2_accum2"):
        assert results[name]["val_mse"] == pytest.approx(trained, rel=1e-5)


@pytest.mark.e2e
def test_the_summary_holds_the_runs_facts_and_the_scripts_own(world_sizes) -> None:
    facts = read_summary(world_sizes["w3"][0], "regression", "x")
    assert facts["launcher"] == "local" and facts["world_size"] == 3
    assert facts["global_step"] == 100 and facts["samples_seen"] == 100 * 96
    assert facts["replicas_in_sync"] is True and len(facts["weights_sha256"]) == 64
    assert facts["val_mse"] == world_sizes["w3"][1]["val_mse"]
    assert facts["best_val_mse"] <= facts["val_mse"]


@pytest.mark.e2e
def test_stopped_mid_epoch_and_rerun_equals_uninterrupted_in_one_mlflow_run(
    tmp_path: Path,
) -> None:
    program = [
        PROGRAM,
        "--epochs",
        "3",
        "--samples",
        "9600",
        "--log-interval",
        "5",
        f"run.output_dir={tmp_path}",
        "preempt.check_every_steps=1",
    ]
    reference = run_local_program(2, [*program, "run.id=reference"])
    assert reference.returncode == 0, reference.stderr[-2000:]

    process = start_program(2, [*program, "run.id=interrupted", "--hold-at-step", "130"])
    log = signal_after(process, r"HOLDING at step 130", signal.SIGUSR1)
    assert process.returncode == EXIT_STOPPED, log[-3000:]
    stop_step = int(re.search(r"checkpoint \(stop signal\) step (\d+)", log).group(1))  # type: ignore[union-attr]
    assert stop_step == 131, "agreed at the check after the signal reached every rank"
    assert "to continue, run the same command with run.id=interrupted" in log
    stopped = load_run(tmp_path / "regression" / "interrupted")
    assert stopped is not None and (stopped.state, stopped.attempts) == ("stopped", 1)
    assert stopped.global_step == stop_step

    resumed = run_local_program(2, [*program, "run.id=interrupted"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {stop_step} (epoch 1, step {stop_step - 100} of the epoch)" in resumed.stderr
    expected, actual = (
        read_summary(tmp_path, "regression", "reference"),
        read_summary(tmp_path, "regression", "interrupted"),
    )
    assert actual["weights_sha256"] == expected["weights_sha256"], "bitwise equal"
    assert actual["val_mse"] == expected["val_mse"] and actual["global_step"] == 300
    assert actual["resumed_from_step"] == stop_step

    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path))
    experiment = client.get_experiment_by_name("hpc_ddp")
    assert experiment is not None
    runs = client.search_runs(
        [experiment.experiment_id], filter_string="tags.`hpc_ddp.job_id` != ''"
    )
    by_id = {run.info.run_id: run for run in runs}
    run = by_id[str(actual["mlflow_run_id"])]
    assert len(runs) == 2, "the interrupted run and its rerun are ONE MLflow run"
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert (tags["hpc_ddp.attempts"], tags["hpc_ddp.attempt.0.end"]) == ("2", "killed")
    assert tags["hpc_ddp.attempt.1.start_step"] == str(stop_step)
    assert tags["hpc_ddp.attempt.1.end"] == "finished"
    assert run.data.params["lr"] == "0.05" and run.data.params["checkpoint.keep_last"] == "3"
    history = client.get_metric_history(run.info.run_id, "interval/mse")
    assert [m.step for m in history] == list(range(5, 301, 5)), "no step lost or repeated"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_mse")] == [
        100,
        200,
        300,
    ]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "mse")] == [100, 200, 300]

    # The run's own record (what `hpc-ddp runs` and `plot` read) agrees with MLflow's.
    finished = load_run(tmp_path / "regression" / "interrupted")
    assert finished is not None and (finished.state, finished.attempts) == ("finished", 2)
    assert (finished.global_step, finished.epoch) == (300, 3)
    assert finished.val["val_mse"] == actual["val_mse"]
    train, _val = curves(tmp_path / "regression" / "interrupted")
    assert train["mse"][0] == [float(step) for step in range(5, 301, 5)]
    assert train["mse"][1] == [m.value for m in history]

    # Where each attempt's time went: rank 0's record of both, the run's in the summary,
    # `hpc-ddp runs` and MLflow.
    stopped_attempt, resumed_attempt = read_attempts(tmp_path / "regression" / "interrupted")
    assert [
        (a["status"], a["from_step"], a["last_step"]) for a in (stopped_attempt, resumed_attempt)
    ] == [
        ("stopped", 0, stop_step),
        ("finished", stop_step, 300),
    ]
    for attempt in (stopped_attempt, resumed_attempt):
        account = attempt["account"]
        parts = sum(account[f"{part}_s"] for part in PARTS)
        assert parts == pytest.approx(account["allocation_s"], abs=0.01)
        assert account["steps_s"] > 0 and account["checkpoint_s"] > 0, account
        assert account["evaluation_s"] > 0, "each attempt evaluated (at 100; at 200 and 300)"
        assert attempt["redone_steps"] == 0 and attempt["ranks"] == 2
    assert stopped_attempt["account"]["resume_s"] == 0 < resumed_attempt["account"]["resume_s"]
    # The stop (the ranks' exchange after the stop's checkpoint) and the end (summary.json and
    # the ranks' spread after the final checkpoint) are parts of their own, each charged to
    # the attempt that ended that way (how long they take is this machine's; the arithmetic
    # is test_time_account.py's).
    assert stopped_attempt["account"]["end_s"] == 0 <= stopped_attempt["account"]["stop_s"]
    assert resumed_attempt["account"]["stop_s"] == 0 <= resumed_attempt["account"]["end_s"]
    total = actual["time_account"]
    assert (total["attempts"], total["attempts_unaccounted"]) == (2, 0)
    assert total["steps_s"] == pytest.approx(
        stopped_attempt["account"]["steps_s"] + resumed_attempt["account"]["steps_s"], abs=0.002
    )
    assert total["goodput_percent"] == round(100 * total["steps_s"] / total["allocation_s"], 2)
    assert finished.goodput == total["goodput_percent"]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "goodput_percent")] == [
        total["goodput_percent"]
    ]


@pytest.mark.e2e
def test_a_module_runs_with_dash_m_and_a_script_runs_with_plain_python(tmp_path: Path) -> None:
    as_module = run_local_program(
        2,
        ["-m", "tests.programs.regression", "--epochs", "1", f"run.output_dir={tmp_path / 'm'}"],
    )
    assert as_module.returncode == 0, as_module.stderr[-2000:]
    assert result_of(as_module.stdout)["global_step"] == 50
    single = run_python([PROGRAM, "--epochs", "1", f"run.output_dir={tmp_path / 'p'}"])
    assert single.returncode == 0, single.stderr[-2000:]
    facts = json.loads(next((tmp_path / "p" / "regression").glob("*/summary.json")).read_text())
    assert facts["world_size"] == 1 and facts["launcher"] == "single"


@pytest.mark.e2e
def test_an_error_in_the_users_code_shows_their_frames_and_the_rank(tmp_path: Path) -> None:
    result = run_local_program(2, [FAULTS, "raise", f"run.output_dir={tmp_path}"])
    assert result.returncode == 1, result.stderr[-3000:]
    assert "rank 1 exited with code 1; stopping the other ranks" in result.stderr
    failure = result.stderr[result.stderr.index("[rank 1] failed:") :]
    assert "ValueError: the user's own check failed on rank 1" in failure
    frames = re.findall(r'File "([^"]+)", line \d+, in (\w+)', failure)
    assert frames[0][0].endswith("faults.py"), "the traceback starts in the user's script"
    assert "check_the_batch" in [name for _file, name in frames], frames
    assert not [path for path, _name in frames if "runpy" in path or "hpc_ddp/launch" in path]
    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path))
    experiment = client.get_experiment_by_name("hpc_ddp")
    assert experiment is not None
    assert [run.info.status for run in client.search_runs([experiment.experiment_id])] == ["FAILED"]


@pytest.mark.e2e
def test_run_deterministic_refuses_an_operation_without_a_deterministic_kernel(
    tmp_path: Path,
) -> None:
    """Tensor.put_ has no deterministic kernel (on CPU too): with run.deterministic=true every
    rank ends with torch's error, the user's frames and a HINT; without it the script trains."""
    common = [FAULTS, "put", f"run.output_dir={tmp_path}", "tracking.enabled=false"]
    plain = run_local_program(2, [*common, "run.id=plain"])
    assert plain.returncode == 0, plain.stderr[-3000:]
    result = run_local_program(2, [*common, "run.id=deterministic", "run.deterministic=true"])
    assert result.returncode == 2, result.stderr[-3000:]
    failure = result.stderr[result.stderr.index("] failed:") :]
    assert "put_ does not have a deterministic implementation" in failure, failure
    assert "scatter_the_counts" in failure
    assert "HINT: run.deterministic=true asks every operation for a deterministic kernel" in (
        failure
    )


def commit_all(checkout: Path) -> str:
    """A git checkout of ``checkout``'s files, committed; returns the commit."""
    for words in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "the script as written"]):
        git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "-C", str(checkout)]
        subprocess.run([*git, *words], check=True, capture_output=True)
    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True)
    return done.stdout.decode().strip()


@pytest.mark.e2e
def test_a_resume_of_an_edited_script_says_what_changed_or_is_refused(tmp_path: Path) -> None:
    """The script (committed in a git checkout) stopped at step 5 (a checkpoint, as on a
    preemption) is edited, then run again: the resume warns, naming the script's new
    sha256; with run.on_code_change=refuse it ends before training. provenance.json keeps
    each attempt, and MLflow's run has each attempt's code as tags, its packages and its
    uncommitted diff as artifacts."""
    checkout = tmp_path / "code"
    checkout.mkdir()
    script = checkout / "train.py"
    shutil.copy(FAULTS, script)
    commit = commit_all(checkout)
    output = tmp_path / "runs"
    common = [str(script), "none", f"run.output_dir={output}", "run.id=edited"]
    first = run_local_program(2, [*common, "preempt.stop_at_step=5"])
    assert first.returncode == EXIT_STOPPED, first.stderr[-3000:]
    before = hashlib.sha256(script.read_bytes()).hexdigest()
    script.write_text(script.read_text() + "# an edit between attempts\n")
    after = hashlib.sha256(script.read_bytes()).hexdigest()
    refused = run_local_program(2, [*common, "run.on_code_change=refuse"])
    assert refused.returncode == 2, refused.stderr[-3000:]
    change = f"the script's contents (sha256): {before} -> {after}"
    assert change in refused.stderr and "HINT: put the code back as it was" in refused.stderr
    resumed = run_local_program(2, common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert change in resumed.stderr and "at step 5 (epoch 0" in resumed.stderr, resumed.stderr[
        -3000:
    ]
    run_dir = output / "faults" / "edited"
    attempts = json.loads((run_dir / "provenance.json").read_text())
    assert [attempt["script_sha256"] for attempt in attempts] == [before, after]
    assert [attempt["git_dirty"] for attempt in attempts] == [False, True]
    assert {attempt["script"] for attempt in attempts} == {str(script)}
    assert attempts[0]["torch"] == torch.__version__ and attempts[0]["packages"]
    listed = run_python(["-m", "hpc_ddp", "runs", str(run_dir)])
    assert listed.returncode == 0, listed.stderr
    shown = re.findall(r"attempt (\d) \(.*\): train\.py sha256 (\w+), commit (\w+)", listed.stdout)
    assert shown == [("1", before[:12], commit[:12]), ("2", after[:12], commit[:12])], listed.stdout

    client = MlflowClient(tracking_uri=default_tracking_uri(output))
    (run,) = client.search_runs(["1"])
    tags = run.data.tags
    assert (tags["mlflow.source.git.commit"], tags["mlflow.source.name"]) == (commit, str(script))
    assert (tags["hpc_ddp.code.script_sha256"], tags["hpc_ddp.code.git_dirty"]) == (after, "true")
    assert tags["hpc_ddp.env.torch"] == torch.__version__
    assert (tags["hpc_ddp.attempt.0.script_sha256"], tags["hpc_ddp.attempt.1.script_sha256"]) == (
        before,
        after,
    ), "the refused attempt never reached MLflow"
    assert (tags["hpc_ddp.attempt.0.git_dirty"], tags["hpc_ddp.attempt.1.git_commit"]) == (
        "false",
        commit,
    )
    artifacts = Path(run.info.artifact_uri.removeprefix("file://")) / "provenance"
    packages = (artifacts / "attempt-1" / "packages.txt").read_text().splitlines()
    assert packages == attempts[1]["packages"] and f"torch=={torch.__version__}" in packages
    diff = (artifacts / "attempt-1" / "git.diff").read_text()
    assert "+# an edit between attempts" in diff
    assert hashlib.sha256(diff.encode()).hexdigest() == attempts[1]["git_diff_sha256"]
    assert not (artifacts / "attempt-0" / "git.diff").exists(), "a clean tree has no diff"


def run_faults(arguments: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """faults.py as plain `python`: errors come through the excepthook."""
    return run_python([FAULTS, *arguments, f"run.output_dir={tmp_path}", "tracking.enabled=false"])


@pytest.mark.parametrize(
    ("program", "message"),
    [
        (["missing.py", "--lr", "1"], "script 'missing.py' does not exist"),
        (["-m", "no_such_package.train"], "module 'no_such_package.train' cannot be found"),
        ([FAULTS, "stateless"], "cannot register settings=dict: it has no state_dict()"),
        ([FAULTS, "bad-config"], "unknown key 'checkpoint.every_stepz'"),
        ([FAULTS, "rank-metric"], "the ranks logged different metrics"),
    ],
)
@pytest.mark.e2e
def test_bad_input_is_one_line_and_exit_2(program: list[str], message: str, tmp_path: Path) -> None:
    result = run_local_program(2, [*program, f"run.output_dir={tmp_path}"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr and "HINT:" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.e2e
def test_plain_python_gets_the_same_one_line_errors(tmp_path: Path) -> None:
    result = run_faults(["stateless"], tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "[rank 0] error: cannot register settings=dict" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.e2e
def test_a_failed_rank_leaves_without_the_interpreters_teardown(tmp_path: Path) -> None:
    """After a failed run the process group is still up, and torch can abort a rank while the
    interpreter tears its modules down (SIGABRT: the launcher saw 134 in place of the
    documented code, rarely, on 2 busy cores; it cannot be forced here). A failed rank
    leaves once its exit handlers ran, without that teardown; a finished rank exits as
    usual. teardown.py marks both."""
    settings = [f"run.output_dir={tmp_path}", "tracking.enabled=false"]
    failed = run_local_program(2, [TEARDOWN, "raise", *settings, "run.id=failed"])
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert failed.stderr.count("exit handler ran") == 2
    assert "module teardown ran" not in failed.stderr

    plain = run_python([TEARDOWN, "raise", *settings, "run.id=plain"])  # the excepthook's way
    assert plain.returncode == 1, plain.stderr[-3000:]
    assert "exit handler ran" in plain.stderr and "module teardown ran" not in plain.stderr

    finished = run_local_program(2, [TEARDOWN, "finish", *settings, "run.id=finished"])
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert finished.stderr.count("module teardown ran") == 2, "the marker shows the teardown"


@pytest.mark.e2e
def test_resuming_with_other_registered_objects_is_refused(tmp_path: Path) -> None:
    first = run_faults(["none", "run.id=x"], tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    second = run_faults(["extra", "run.id=x"], tmp_path)
    assert second.returncode == 2, second.stderr[-2000:]
    assert "holds ['model', 'optimizer'], this run registered ['ema', 'model', 'optimizer']" in (
        second.stderr
    )
    assert "(not in the checkpoint: ema)" in second.stderr and "Traceback" not in second.stderr


@pytest.mark.e2e
def test_submitit_runs_a_callable_and_a_script_on_every_rank(tmp_path: Path) -> None:
    """submitit's local executor (no Slurm): the callable's return value from every rank."""
    arguments = ["--epochs", "1", f"run.output_dir={tmp_path / 'call'}", "tracking.enabled=false"]
    job = hpc_ddp.submit(
        regression.main,
        args=(arguments,),
        cluster="local",
        tasks_per_node=2,
        folder=tmp_path / "submitit",
        time="10",
    )
    results = hpc_ddp.wait(job)
    assert [r["world_size"] for r in results] == [2, 2]
    assert {r["launcher"] for r in results} == {"submitit-local"}
    assert results[0]["weights_sha256"] == results[1]["weights_sha256"]
    assert results[0]["val_count"] == 1001 and results[0]["global_step"] == 50

    script = hpc_ddp.submit(
        [PROGRAM, "--epochs", "1", f"run.output_dir={tmp_path / 'script'}"],
        cluster="local",
        tasks_per_node=2,
        folder=tmp_path / "submitit",
        time="10",
    )
    assert hpc_ddp.wait(script) == [None, None]
    facts = json.loads(next((tmp_path / "script").glob("*/*/summary.json")).read_text())
    assert facts["world_size"] == 2 and facts["global_step"] == 50


def test_what_cannot_be_sent_to_a_job_is_refused_before_submission(tmp_path: Path) -> None:
    lock = threading.Lock()

    def holds_a_lock() -> bool:
        return lock.locked()

    with pytest.raises(hpc_ddp.HpcDdpError, match="cannot be pickled"):
        hpc_ddp.submit(holds_a_lock, cluster="local", folder=tmp_path)
    with pytest.raises(hpc_ddp.HpcDdpError, match=re.escape("script 'absent.py' does not exist")):
        hpc_ddp.submit("absent.py", cluster="local", folder=tmp_path)


BUCKETS = """
import json, torch
from torch import nn
import hpc_ddp
run = hpc_ddp.start(tracking={"enabled": False}, checkpoint={"enabled": False})
net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
model = WRAPPED
untouched = [p.grad is None for p in model.parameters()]
model(torch.randn(3, 4)).sum().backward()
first = model._get_ddp_logging_data()
model(torch.randn(3, 4)).sum().backward()
second = model._get_ddp_logging_data()
print(json.dumps([untouched, first.get("has_rebuilt_buckets"),
                  first.get("rebuilt_per_bucket_param_indices"),
                  second.get("rebuilt_per_bucket_param_indices")]))
run.finish()
"""


@pytest.mark.e2e
@pytest.mark.parametrize(
    "wrapped",
    [
        "run.wrap(net)",
        "nn.parallel.DistributedDataParallel(net)\nrun.register(model=model)",
    ],
    ids=["run.wrap", "own-ddp-registered"],
)
def test_ddp_buckets_are_laid_out_before_the_first_step(wrapped: str, tmp_path: Path) -> None:
    """DDP rebuilds its buckets after its first backward; a resumed run's first step would
    then sum gradients in another order than the uninterrupted run's same step (bitwise
    different at 3+ ranks). wrap() lays them out at once, as DDP would have rebuilt them,
    and so does registering a DDP the script built itself."""
    script = BUCKETS.replace("WRAPPED", wrapped)
    result = run_python(["-c", script], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    untouched, rebuilt, order, order_later = json.loads(result.stdout.splitlines()[-1])
    assert untouched == [True] * 4, "the layout pass leaves no gradient behind"
    assert rebuilt == 1 and order == "3 2 1 0", "reverse parameter order, from the first step"
    assert order_later == order, "and DDP keeps it"


LATE_REGISTRATION = """
import json, torch
from torch import nn
import hpc_ddp
run = hpc_ddp.start(tracking={"enabled": False}, checkpoint={"enabled": False})
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
model(torch.ones(3, 4)).sum().backward()
before = [p.grad.clone() for p in model.parameters()]
run.register(model=model)
print(json.dumps([p.grad is not None and torch.equal(p.grad, b)
                  for p, b in zip(model.parameters(), before)]))
run.finish()
"""


@pytest.mark.e2e
def test_a_ddp_registered_after_a_backward_keeps_its_gradients(tmp_path: Path) -> None:
    """Laying out the buckets runs a backward of its own: on a model registered after one,
    it would drop the gradients the script is about to apply. It is left alone, said once."""
    result = run_python(["-c", LATE_REGISTRATION], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.splitlines()[-1]) == [True, True]
    assert result.stderr.count("run.register got a DistributedDataParallel after its") == 1
    assert "HINT: register the model before training starts" in result.stderr


class Point(NamedTuple):
    x: torch.Tensor
    label: str


@dataclasses.dataclass
class Pair:
    left: torch.Tensor
    right: list[torch.Tensor]


def test_batches_of_any_structure_keep_their_shape_when_moved() -> None:
    point = Point(torch.ones(2), "a")
    batch = {"point": point, "pairs": [Pair(torch.zeros(1), [torch.ones(3)])], "ids": (1, 7)}
    moved = move_to(batch, torch.device("cpu"))
    assert type(moved["point"]) is Point and moved["point"].label == "a"
    assert type(moved["pairs"][0]) is Pair and moved["pairs"][0].right[0].tolist() == [1.0] * 3
    assert type(moved["ids"]) is tuple and moved["ids"][1] == 7
    assert torch.equal(moved["point"].x, point.x)


class CountingDataset(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self, size: int) -> None:
        self.size = size
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        self.loaded.append(index)
        return torch.tensor(index)


def test_a_loader_started_mid_epoch_skips_without_loading() -> None:
    """The consumed samples' indices are skipped: they are never read from the dataset."""
    whole, resumed = CountingDataset(103), CountingDataset(103)
    options = {"rank": 1, "world_size": 2, "global_batch_size": 8, "seed": 3, "num_workers": 0}
    full = TrainLoader(whole, grad_accum_steps=2, device=None, **options)  # type: ignore[arg-type]
    part = TrainLoader(resumed, grad_accum_steps=2, device=None, **options)  # type: ignore[arg-type]
    assert (full.steps_per_epoch, full.micro_batch_size) == (12, 2), "51 samples, 2 per micro"
    full.set_position(4, 0)
    part.set_position(4, 5)
    every = [batch.tolist() for batch in full]
    rest = [batch.tolist() for batch in part]
    assert rest == every[10:], "5 steps x 2 micro-batches later, the same order"
    assert resumed.loaded == [i for batch in rest for i in batch], "nothing before was read"


EPOCHS_BY_HAND = """
import json, torch
from torch import nn
import hpc_ddp
run = hpc_ddp.start(tracking={"enabled": False}, checkpoint={"enabled": False})
model = run.wrap(nn.Linear(2, 1))
data = torch.utils.data.TensorDataset(torch.randn(40, 2), torch.randn(40, 1))
loader = run.train_loader(data, 10)
seen = []
for epoch in range(3):
    for x, y in run.steps(loader):
        nn.functional.mse_loss(model(x), y).backward()
        run.log("n", len(x))
    seen.append((run.epoch, run.global_step, run.train_metrics["n"].count))
print(json.dumps(seen))
run.finish()
"""


@pytest.mark.e2e
def test_without_epochs_every_steps_call_is_an_epoch(tmp_path: Path) -> None:
    result = run_python(["-c", EPOCHS_BY_HAND], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.splitlines()[-1]) == [[1, 4, 4.0], [2, 8, 4.0], [3, 12, 4.0]]


@pytest.mark.parametrize("declared", ["USR1", "B:USR1@90", "SIGUSR1", "usr1"])
def test_each_spelling_of_the_job_s_warning_signal_is_read(declared: str) -> None:
    """#SBATCH --signal's forms, as slurm/train.sh exports them, against preempt.signal."""
    with pytest.raises(HpcDdpError, match="the job's warning signal is 'USR1'"):
        check_job_signal({JOB_SIGNAL_VARIABLE: declared}, "USR2")
    check_job_signal({JOB_SIGNAL_VARIABLE: declared}, "USR1")
    check_job_signal({}, "USR2")


@pytest.mark.e2e
def test_a_job_whose_warning_signal_the_ranks_do_not_handle_is_refused(tmp_path: Path) -> None:
    """What slurm/train.sh exports for its #SBATCH --signal, against preempt.signal, as the
    ranks see it."""
    environment = clean_environ(HPC_DDP_JOB_SIGNAL="B:USR1@90")
    result = run_local_program(
        2, [FAULTS, "none", f"run.output_dir={tmp_path}", "preempt.signal=USR2"], 60, environment
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "the job's warning signal is 'USR1'" in result.stderr
    assert "ranks handle preempt.signal=USR2" in result.stderr and "HINT:" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "faults").exists()
    matching = clean_environ(HPC_DDP_JOB_SIGNAL="USR2")
    result = run_local_program(
        1,
        [FAULTS, "none", f"run.output_dir={tmp_path}", "preempt.signal=USR2", "run.id=ok"],
        60,
        matching,
    )
    assert result.returncode == 0, result.stderr[-2000:]


def steps_seen(folder: Path) -> dict[int, list[int]]:
    """Every optimizer step's sample ids, over all ranks and attempts (regression.py's
    --record-ids)."""
    seen: dict[int, list[int]] = {}
    for path in folder.glob("ids-*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            seen.setdefault(entry["step"], []).extend(entry["ids"])
    return {step: sorted(ids) for step, ids in sorted(seen.items())}


@pytest.mark.e2e
def test_a_run_stopped_on_4_ranks_resumes_on_2_and_on_3_with_the_same_global_order(
    tmp_path: Path,
) -> None:
    """The global batch (96) divides over 4, 3 and 2 ranks. Stopped mid-epoch on 4 ranks,
    resumed on 2 and on 3: every step holds the same samples as in an uninterrupted 2-rank
    run (asserted on each step's sample ids), and the weights agree to rounding (the
    all-reduce sums in another order)."""
    program = [PROGRAM, "--epochs", "2", "--samples", "9600", "--log-interval", "5",
               f"run.output_dir={tmp_path}", "preempt.check_every_steps=1"]  # fmt: skip
    for folder in ("ids-reference", "ids-to2", "ids-to3"):
        (tmp_path / folder).mkdir()
    reference = run_local_program(
        2, [*program, "run.id=reference", "tracking.enabled=false",
            "--record-ids", str(tmp_path / "ids-reference")],
    )  # fmt: skip
    assert reference.returncode == 0, reference.stderr[-2000:]

    process = start_program(
        4, [*program, "run.id=to2", "--record-ids", str(tmp_path / "ids-to2"),
            "--hold-at-step", "40"],
    )  # fmt: skip
    log = signal_after(process, r"HOLDING at step 40", signal.SIGUSR1)
    assert process.returncode == EXIT_STOPPED, log[-3000:]
    stop_step = int(re.search(r"checkpoint \(stop signal\) step (\d+)", log).group(1))  # type: ignore[union-attr]
    assert stop_step == 41, stop_step
    shutil.copytree(tmp_path / "regression" / "to2", tmp_path / "regression" / "to3")
    for path in (tmp_path / "ids-to2").iterdir():
        shutil.copy(path, tmp_path / "ids-to3")

    for ranks in (2, 3):
        resumed = run_local_program(
            ranks, [*program, f"run.id=to{ranks}", "--record-ids", str(tmp_path / f"ids-to{ranks}"),
                    *([] if ranks == 2 else ["tracking.enabled=false"])],
        )  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"checkpoint was written by 4 ranks, this run has {ranks}" in resumed.stderr
        assert steps_seen(tmp_path / f"ids-to{ranks}") == steps_seen(tmp_path / "ids-reference")
        facts = read_summary(tmp_path, "regression", f"to{ranks}")
        assert (facts["world_size"], facts["resumed_from_world_size"]) == (ranks, 4)
        assert (facts["resumed_from_step"], facts["global_step"]) == (stop_step, 200)
        expected = final_weights(tmp_path, "reference")
        actual = final_weights(tmp_path, f"to{ranks}")
        for name, tensor in expected.items():
            torch.testing.assert_close(actual[name], tensor, rtol=1e-4, atol=1e-5)
    assert len(steps_seen(tmp_path / "ids-reference")) == 200
    assert all(len(ids) == 96 for ids in steps_seen(tmp_path / "ids-reference").values())

    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path))
    run = client.get_run(str(read_summary(tmp_path, "regression", "to2")["mlflow_run_id"]))
    tags = run.data.tags
    assert tags["hpc_ddp.world_size_change"] == "4 -> 2"
    attempts = (tags["hpc_ddp.attempt.0.world_size"], tags["hpc_ddp.attempt.1.world_size"])
    assert attempts == ("4", "2")


@pytest.mark.e2e
def test_run_deterministic_two_runs_with_dataloader_workers_end_bitwise_equal(
    tmp_path: Path,
) -> None:
    """digits_cnn (augmentation in 2 DataLoader workers per rank) twice with
    run.deterministic=true: the same weights, bit for bit."""
    program = [str(REPO / "examples" / "digits_cnn" / "train.py"), "--epochs", "1",
               "--workers", "2"]  # fmt: skip
    sums = []
    for run_id in ("first", "second"):
        settings = [f"--set=run.output_dir={tmp_path}", f"--set=run.id={run_id}",
                    "--set=run.deterministic=true", "--set=tracking.enabled=false"]  # fmt: skip
        result = run_local_program(2, [*settings, *program])
        assert result.returncode == 0, result.stderr[-3000:]
        sums.append(read_summary(tmp_path, run_id=run_id)["weights_sha256"])
    assert sums[0] is not None and sums[0] == sums[1]
