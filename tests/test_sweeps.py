"""A sweep's parts that need no cluster: the sweep file and its expansion (grid, zip, list),
the settings refused with a clear message, job arrays split at MaxArraySize, the job script
each array runs, what a task's ranks get, the record written under a lock, and the status
table made from it. The sweep on a real cluster is tests/test_slurm_sweep.py."""

from __future__ import annotations

import inspect
import json
import multiprocessing
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from hpc_ddp.cli.api import trainer_settings
from hpc_ddp.cli.app import main as cli_main
from hpc_ddp.launch.program import Program
from hpc_ddp.launch.sbatch import RenderRequest
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.tracking.membership import SweepMembership, read_membership, write_membership
from hpc_ddp.sweep import manifest
from hpc_ddp.sweep.arrays import Array, array_spec, job_script, max_array_size, split_into_arrays
from hpc_ddp.sweep.programs import check_settings
from hpc_ddp.sweep.spec import expand, parse_values, spec_from_dict
from hpc_ddp.sweep.task import attempt_run_state, ended_state, task_environ, task_program
from hpc_ddp.sweep.views import format_rows, task_rows, task_state, this_attempts_state
from hpc_ddp.view.runs import RunView


def tasks_of(raw: dict[str, Any]) -> list[dict[str, str]]:
    return expand(spec_from_dict({"name": "s", **raw}, "sweep.yaml"))


def test_a_grid_is_every_combination_in_order() -> None:
    tasks = tasks_of({"grid": {"--lr": [0.1, 0.01], "run.seed": [1, 2, 3]}})
    assert tasks == [
        {"--lr": "0.1", "run.seed": "1"},
        {"--lr": "0.1", "run.seed": "2"},
        {"--lr": "0.1", "run.seed": "3"},
        {"--lr": "0.01", "run.seed": "1"},
        {"--lr": "0.01", "run.seed": "2"},
        {"--lr": "0.01", "run.seed": "3"},
    ]


def test_list_entries_times_zip_rows_times_grid() -> None:
    tasks = tasks_of(
        {
            "list": [{"--opt": "sgd"}, {"--opt": "adam", "--beta": 0.9}],
            "zip": {"--width": [64, 128], "--depth": [2, 4]},
            "grid": {"--flag": [True, False]},
        }
    )
    assert len(tasks) == 2 * 2 * 2
    assert tasks[0] == {"--opt": "sgd", "--width": "64", "--depth": "2", "--flag": "true"}
    assert tasks[3] == {"--opt": "sgd", "--width": "128", "--depth": "4", "--flag": "false"}
    assert tasks[-1] == {
        "--opt": "adam",
        "--beta": "0.9",
        "--width": "128",
        "--depth": "4",
        "--flag": "false",
    }


def test_no_grid_zip_or_list_is_one_task_and_a_single_value_is_a_list_of_one() -> None:
    assert tasks_of({}) == [{}]
    assert tasks_of({"grid": {"--lr": 0.1}}) == [{"--lr": "0.1"}]
    # A plain word is the program's option, as with --grid lr=0.1 and in Python.
    assert tasks_of({"grid": {"lr": [0.1]}, "list": [{"wd": 1}]}) == [{"--wd": "1", "--lr": "0.1"}]


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ({"grdi": {"--lr": [1]}}, "unknown key 'grdi'"),
        ({"grid": {"--lr": []}}, "grid.--lr: the list is empty"),
        ({"zip": {"--a": [1, 2], "--b": [1, 2, 3]}}, "different lengths (--a: 2, --b: 3)"),
        ({"grid": {"--a": [1, 2]}, "zip": {"--a": [3, 4]}}, "--a is swept in both grid and zip"),
        ({"grid": {"--a": list(range(40)), "--b": list(range(30))}}, "1200 tasks, more than"),
        ({"grid": {"--a": [1, 2, 3]}, "max_tasks": 2}, "3 tasks, more than max_tasks=2"),
        ({"grid": {"l r": [1]}}, "'l r' is neither an option of your program"),
        ({"concurency": 1}, "unknown key 'concurency' (did you mean 'concurrency'?)"),
        ({"grid": {"lr": [1, 2], "--lr": [3]}}, "grid: --lr is given twice"),
        ({"list": [{"lr": 1, "--lr": 2}]}, "list[0]: --lr is given twice"),
        ({"grid": {"run.id": [1, 2]}}, "run.id is set by the sweep"),
        ({"grid": {"--lr": [[1, 2]]}}, "is a list, not a single value"),
        ({"list": []}, "list: expected a non-empty list"),
        ({"list": [5]}, "list[0]: 5 is not a mapping"),
        ({"concurrency": 0}, "concurrency: 0 is not a whole number at least 1"),
        ({"mode": "best"}, "mode='best'"),
        ({"name": "a/b"}, "name='a/b' cannot name the sweep's folder"),
    ],
)
def test_settings_that_cannot_be_expanded_are_refused_with_the_reason(
    raw: dict[str, Any], says: str
) -> None:
    with pytest.raises(HpcDdpError, match="HINT") as refused:
        tasks_of(raw)
    assert says in str(refused.value)


def test_dotted_keys_must_be_the_programs_settings() -> None:
    check_settings(["--anything", "run.seed", "checkpoint.every_steps"], Program("script", "t.py"))
    with pytest.raises(HpcDdpError, match=r"did you mean run\.seed"):
        check_settings(["run.sed"], Program("script", "t.py"))
    trainer = trainer_settings()
    check_settings(["train.epochs", "optim.lr"], Program("builtin", ""), trainer)
    with pytest.raises(HpcDdpError, match="not a setting of the built-in trainer"):
        check_settings(["optim.learning_rate"], Program("builtin", ""), trainer)
    with pytest.raises(HpcDdpError, match="not a setting of the built-in trainer"):
        check_settings(["train.epochs"], Program("builtin", ""))  # nobody said the trainer's


def test_the_command_line_form_reads_plain_keys_as_program_options() -> None:
    assert parse_values("lr=0.1,0.01", "--grid") == ("--lr", ("0.1", "0.01"))
    assert parse_values("run.seed=1,2", "--grid") == ("run.seed", ("1", "2"))
    with pytest.raises(HpcDdpError, match="is not KEY=V1,V2"):
        parse_values("lr", "--grid")


def test_arrays_are_split_at_max_array_size_with_offsets() -> None:
    assert max_array_size("Foo = 1\nMaxArraySize            = 8\n") == 8
    assert max_array_size("no such line") == 1001
    with pytest.raises(HpcDdpError, match=r"takes no job arrays \(MaxArraySize=0\)"):
        max_array_size("MaxArraySize = 0\n")
    assert split_into_arrays(list(range(10)), 8) == [
        Array(0, tuple(range(8))),
        Array(8, (0, 1)),
    ]
    assert split_into_arrays([3, 9, 17], 8) == [Array(0, (3,)), Array(8, (1,)), Array(16, (1,))]
    assert Array(8, (0, 1)).tasks == (8, 9)
    assert array_spec([0, 1, 2, 4, 6, 7], 2) == "0-2,4,6-7%2"
    assert array_spec([5], None) == "5"


def test_the_array_job_script_runs_the_task_and_records_its_end(tmp_path: Path) -> None:
    request = RenderRequest(arguments=("-m", "hpc_ddp.sweep.task"), nodes=2, gpus_per_node=4)
    text = job_script(request, tmp_path / "my sweep", 8)
    assert "#SBATCH --output=%x-%A_%a.out" in text
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=4" in text
    task = f"-m hpc_ddp.sweep.task '{tmp_path}/my sweep' --offset 8"
    assert f"program=({task})" in text
    srun = 'srun --kill-on-bad-exit=1 --label "${blocked_until_held[@]}" "$python" "${program[@]}"'
    assert text.index(srun) < text.index(f'"$python" {task} --ended "$status"')
    assert text.rstrip().endswith('exit "$status"')
    # A rank lost to its host: rank 0's hand-off is kept, srun's lines of this attempt are
    # read, and a requeued task ends its script before the sweep's record says it ended.
    assert "export HPC_DDP_STEP_HANDOFF=" in text and "unset HPC_DDP_STEP_HANDOFF" not in text
    answer = '"$python" -m hpc_ddp.launch.step_failure "$status" "$log_from" || answered=$?'
    assert text.index("log_from=") < text.index(srun) < text.index(answer)
    requeued = text.index("if ((answered == 0)); then\n        exit 0\n    fi")
    assert text.index(answer) < requeued < text.index(f'"$python" {task} --ended "$status"')


def sweep_record(tmp_path: Path, tasks: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "name": "s",
        "program": {"kind": "script", "name": "train.py", "args": ["--epochs", "2"]},
        "output_dir": str(tmp_path),
        "tracking": {"uri": "sqlite:////x/mlflow.db", "experiment": "exp 1", "parent_run_id": "p"},
        "arrays": [{"job_id": "7", "offset": 0, "tasks": list(range(len(tasks)))}],
        "tasks": [manifest.new_task(i, task, f"task-{i:03d}") for i, task in enumerate(tasks)],
    }


def test_a_tasks_ranks_get_its_options_its_settings_and_its_run_directory(
    tmp_path: Path,
) -> None:
    data = sweep_record(tmp_path, [{"--lr": "0.1", "run.seed": "3"}])
    task = data["tasks"][0]
    assert task_program(data, task) == Program(
        "script", "train.py", ("--epochs", "2", "--lr", "0.1")
    )
    environ = {"HPC_DDP_OVERRIDES": "checkpoint.every_steps=5", "MLFLOW_RUN_ID": "x", "A": "1"}
    changed = task_environ(data, task, environ)
    assert "MLFLOW_RUN_ID" not in changed and changed["A"] == "1"
    assert shlex.split(changed["HPC_DDP_OVERRIDES"]) == [
        "checkpoint.every_steps=5",
        "run.seed=3",
        f"run.output_dir={tmp_path}",
        "run.name=s",
        "run.id=task-000",
        "tracking.uri=sqlite:////x/mlflow.db",
        "tracking.experiment=exp 1",
    ]


def test_membership_makes_the_run_a_tagged_child_with_its_settings_as_params(
    tmp_path: Path,
) -> None:
    member = SweepMembership("s", 4, {"--lr": "0.1", "run.seed": "2"}, "parent", ("--lr=0.05",))
    write_membership(tmp_path / "run", member)
    assert read_membership(tmp_path / "run") == member
    assert member.tags() == {
        "hpc_ddp.sweep": "s",
        "hpc_ddp.sweep.task": "4",
        "mlflow.parentRunId": "parent",
        "hpc_ddp.sweep.overrides": "--lr=0.05",
    }
    assert member.params() == {"sweep.lr": "0.1", "sweep.run.seed": "2"}
    (tmp_path / "run" / "sweep-task.json").write_text("{not json")
    assert read_membership(tmp_path / "run") is None


def _mark_running(sweep_dir: str) -> None:
    def running(task: dict[str, Any]) -> None:
        task.update(state="running", attempts=task["attempts"] + 1)

    for _ in range(20):
        for index in range(4):
            _data, task = manifest.read_task(Path(sweep_dir), index)
            manifest.update_tasks(Path(sweep_dir), [task], running)


@pytest.mark.e2e
def test_the_record_loses_no_change_when_tasks_write_it_at_once(tmp_path: Path) -> None:
    """Four processes change each of four tasks 20 times, at once: every change is kept
    (the lock), and every read in between sees whole files (the rename)."""
    manifest.create_manifest(tmp_path, sweep_record(tmp_path, [{}, {}, {}, {}]))
    with pytest.raises(HpcDdpError, match="already holds a sweep"):
        manifest.create_manifest(tmp_path, sweep_record(tmp_path, [{}]))
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_mark_running, args=(str(tmp_path),)) for _ in range(4)]
    for worker in workers:
        worker.start()
    while any(worker.is_alive() for worker in workers):
        manifest.read_manifest(tmp_path)
    assert [worker.exitcode for worker in workers] == [0] * 4
    assert [task["attempts"] for task in manifest.read_manifest(tmp_path)["tasks"]] == [80] * 4


def test_what_tasks_do_is_kept_beside_the_record_which_stays_as_submitted(
    tmp_path: Path,
) -> None:
    """A task's start and end, an array and a resume change small files beside sweep.json,
    never sweep.json itself (rewriting it whole made a 100,000-task sweep quadratic); the
    record read back joins them: each task's own state, a waiting task's newest job."""
    data = sweep_record(tmp_path, [{"--lr": "0.1"}, {"--lr": "0.2"}, {"--lr": "0.3"}])
    data["arrays"] = []
    manifest.create_manifest(tmp_path, data)
    written = manifest.manifest_path(tmp_path).read_bytes()
    manifest.record_array(tmp_path, "7", 0, [0, 1, 2], "array-0.sh")
    record = manifest.read_manifest(tmp_path)
    assert [task["job"] for task in record["tasks"]] == ["7_0", "7_1", "7_2"]

    def running(task: dict[str, Any]) -> None:
        task.update(state="running", attempts=task["attempts"] + 1, job="7_1")

    def failed(task: dict[str, Any]) -> None:
        task.update(state="failed", error="exit code 1")

    assert manifest.update_tasks(tmp_path, [record["tasks"][1]], running) == 0
    assert manifest.update_tasks(tmp_path, [record["tasks"][2]], failed) == 1
    assert manifest.update_tasks(tmp_path, [record["tasks"][2]], failed) == 1, "ended once"
    record = manifest.read_manifest(tmp_path)
    assert [(t["state"], t["attempts"], t["job"]) for t in record["tasks"]] == [
        ("pending", 0, "7_0"),
        ("running", 1, "7_1"),
        ("failed", 0, "7_2"),
    ]

    def reset(task: dict[str, Any]) -> None:  # as sweep resume --set --lr=1 does
        task.update(state="pending", job=None, settings={"--lr": "1"}, since_array=1)

    assert manifest.update_tasks(tmp_path, [record["tasks"][2]], reset) == 0
    assert manifest.read_manifest(tmp_path)["tasks"][2]["job"] is None, "not array 7's"
    manifest.record_array(tmp_path, "9", 2, [2], "array-1.sh")
    _definition, task = manifest.read_task(tmp_path, 2)
    assert (task["state"], task["settings"]) == ("pending", {"--lr": "1"})
    assert manifest.read_manifest(tmp_path)["tasks"][2]["job"] == "9_0"
    assert manifest.manifest_path(tmp_path).read_bytes() == written

    (tmp_path / "state" / "task-001.json").write_text("{torn")
    with pytest.raises(HpcDdpError, match=r"cannot read .*task-001\.json"):
        manifest.read_manifest(tmp_path)
    (tmp_path / "state" / "task-001.json").unlink()
    assert manifest.read_manifest(tmp_path)["tasks"][1]["state"] == "pending"
    with (tmp_path / "arrays.jsonl").open("a") as handle:
        handle.write('{"job_id": "10", "offset": 0, "tasks": [5]}\n')
    with pytest.raises(HpcDdpError, match=r"array 2 is damaged: .* a task the sweep does not"):
        manifest.read_manifest(tmp_path)


def test_a_sweep_recorded_by_the_earlier_format_counts_its_ended_tasks(tmp_path: Path) -> None:
    """A record of format 1 keeps its tasks' states in sweep.json: the tasks it says ended
    count, so the sweep's last end still closes its MLflow parent run; a count left high
    (a process killed between the count and the mark) is set right from the marks."""
    from hpc_ddp.sweep.taskstate import recount

    data = sweep_record(tmp_path, [{}, {}, {}])
    for task, state in zip(data["tasks"], ["finished", "failed", "running"], strict=True):
        task["state"] = state
    manifest.write_manifest(tmp_path, {"format": 1, **data})

    def finished(task: dict[str, Any]) -> None:
        task.update(state="finished")

    _definition, last = manifest.read_task(tmp_path, 2)
    assert manifest.update_tasks(tmp_path, [last], finished) == 3
    assert recount(tmp_path) == 3
    assert [task["state"] for task in manifest.read_manifest(tmp_path)["tasks"]] == [
        "finished",
        "failed",
        "finished",
    ]
    (tmp_path / "state" / "ended.count").write_text("7\n")
    assert recount(tmp_path) == 3


STAND_IN_SBATCH = """#!/bin/sh
n=$(($(cat "$0.count" 2>/dev/null || echo 0) + 1))
echo "$n" > "$0.count"
if [ "$n" = "2" ] && [ -e "$0.refuse" ]; then
    echo "sbatch: error: QOSMaxSubmitJobPerUserLimit" >&2
    exit 1
fi
echo "$n"
"""


@pytest.mark.e2e
def test_sbatch_refusing_a_later_array_says_which_tasks_are_queued_and_how_to_submit_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five tasks in arrays of two (a stand-in sbatch, the cluster's refusal in its place):
    the second array refused leaves the first queued; the message names both sets and the
    resume that submits the rest, which then queues every task that did not finish."""
    from hpc_ddp.sweep.resume import resume_sweep
    from hpc_ddp.sweep.submit import submit_sweep

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "sbatch": STAND_IN_SBATCH,
        "scontrol": "#!/bin/sh\necho 'MaxArraySize = 2'\n",
        "squeue": "#!/bin/sh\nexit 0\n",
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (bin_dir / "sbatch.refuse").touch()
    environ = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HPC_DDP_OVERRIDES": "tracking.enabled=false"}
    spec = spec_from_dict({"name": "s", "grid": {"--lr": [1, 2, 3, 4, 5]}}, "sweep.yaml")
    program = Program("script", "tests/programs/regression.py")
    said: list[str] = []
    with pytest.raises(HpcDdpError) as refused:
        submit_sweep(spec, program, RenderRequest(arguments=()), tmp_path, environ, said.append)
    message = str(refused.value)
    assert "QOSMaxSubmitJobPerUserLimit" in message, message
    assert "tasks 0-1 are queued (job arrays 1), tasks 2-4 are not" in message, message
    assert f"hpc-ddp sweep resume {tmp_path / 's'}" in message, message
    assert said[-1] == "submitted job array 1 (--array=0-1): tasks 0-1"
    record = manifest.read_manifest(tmp_path / "s")
    assert [task["job"] for task in record["tasks"]] == ["1_0", "1_1", None, None, None]

    (bin_dir / "sbatch.refuse").unlink()
    monkeypatch.chdir(tmp_path)
    assert resume_sweep(Path("s"), (), environ, said.append) == [0, 1, 2, 3, 4]
    record = manifest.read_manifest(tmp_path / "s")
    assert [task["job"] for task in record["tasks"]] == ["3_0", "3_1", "4_0", "4_1", "5_0"]
    resumed = [array for array in record["arrays"] if array["job_id"] in ("3", "4", "5")]
    assert [Path(array["script"]).is_absolute() for array in resumed] == [True] * 3, (
        "a resume from the sweep's parent names its folder absolutely, as the submit did"
    )
    assert f"hpc_ddp.sweep.task {tmp_path / 's'} --offset" in Path(resumed[0]["script"]).read_text()


def test_a_tasks_state_joins_its_record_and_slurms_queue() -> None:
    assert task_state("running", "RUNNING", True) == "running"
    assert task_state("running", "PENDING", True) == "requeued"
    assert task_state("pending", "PENDING", True) == "pending"
    assert task_state("running", None, True) == "lost"
    assert task_state("running", None, True, "stopped") == "stopped", "cancelled: checkpointed"
    assert task_state("running", None, True, "running") == "lost", "killed without a word"
    assert task_state("running", "RUNNING", True, "stopped") == "running"
    assert task_state("pending", None, True) == "lost"
    assert task_state("running", None, False) == "running"
    assert task_state("failed", None, True) == "failed"
    assert task_state("finished", "COMPLETING", True) == "finished"
    assert ended_state(0, "finished") == "finished"
    assert ended_state(0, None) == "finished"  # a program that is no hpc_ddp run
    assert ended_state(1, "failed") == "failed"
    assert ended_state(0, "requeued") == "requeued"
    assert ended_state(137, "running") == "failed"


def test_a_runs_state_counts_for_the_attempt_only_when_written_after_it_started(
    tmp_path: Path,
) -> None:
    run = RunView(tmp_path, "s", "task-001", "stopped", 28, 0, 1, updated=1000.0)
    assert this_attempts_state(run, {"updated": 999.0}) == "stopped"
    assert this_attempts_state(run, {"updated": 1001.0}) is None, "an earlier attempt's stop"
    assert this_attempts_state(None, {"updated": 1.0}) is None


def test_an_attempt_that_ended_before_its_run_started_is_not_taken_for_an_earlier_one(
    tmp_path: Path,
) -> None:
    """Attempt 1 stopped and was requeued (its run's record says so); attempt 2's ranks
    died before Python's first line (srun: exit 143). Its record must say failed, not keep
    the earlier "requeued", which left the task waiting in the sweep's record for ever."""
    earlier = RunView(tmp_path, "lr", "task-001", "requeued", 28, 0, 1, updated=1000.0)
    assert attempt_run_state(earlier, began=1005.5) is None
    assert ended_state(143, attempt_run_state(earlier, began=1005.5)) == "failed"
    assert attempt_run_state(earlier, began=999.0) == "requeued", "written by this attempt"
    assert attempt_run_state(earlier, began=None) == "requeued", "start unknown: as before"
    assert attempt_run_state(None, began=1005.5) is None


def test_status_sorts_finished_tasks_best_first_and_names_the_failure(tmp_path: Path) -> None:
    data = sweep_record(tmp_path, [{"--lr": "0.1"}, {"--lr": "0.2"}, {"--lr": "9"}])
    data["metric"] = "val_loss"
    for index, value in ((0, 0.5), (1, 0.25)):
        manifest.set_task(data["tasks"][index], state="finished", final={"val_loss": value})
    manifest.set_task(data["tasks"][2], state="failed", error="exit code 1: see log")
    manifest.create_manifest(tmp_path, data)
    rows, metric, mode = task_rows(manifest.read_manifest(tmp_path), {})
    assert (metric, mode) == ("val_loss", "min")
    assert [(row.index, row.state, row.metric) for row in rows] == [
        (1, "finished", 0.25),
        (0, "finished", 0.5),
        (2, "failed", None),
    ]
    table = format_rows(rows, metric, mode)
    assert "1 failed, 2 finished" in table and "task 2: exit code 1: see log" in table
    assert "last val_loss (lower is better)" in table.splitlines()[0], "the last value, not a min"


def test_a_sweep_named_by_the_wrong_path_or_metric_is_refused_with_the_right_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep's name without runs/, a sweep's folder given to `plot`, and a metric no task
    logged: each refusal names what was meant."""
    from hpc_ddp.sweep.resume import resume_sweep
    from hpc_ddp.sweep.views import plot_sweep
    from hpc_ddp.view.runs import find_run

    data = sweep_record(tmp_path / "runs", [{"--lr": "0.1"}])
    sweep_dir = tmp_path / "runs" / "s"
    manifest.create_manifest(sweep_dir, data)
    run_dir = manifest.run_dir_of(data, data["tasks"][0])
    run_dir.mkdir(parents=True)
    point = {"step": 5, "global_step": 5, "epoch": 0, "time": 1.0,
             "metrics": {"val_accuracy": 0.5, "interval/loss": 1.0}}  # fmt: skip
    (run_dir / "metrics.jsonl").write_text(json.dumps(point) + "\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(HpcDdpError) as named:
        manifest.read_manifest(Path("s"))
    assert named.value.hint.startswith("did you mean runs/s? Else pass the folder")
    with pytest.raises(HpcDdpError) as named:
        resume_sweep(Path("s"), (), {}, print)
    assert named.value.hint.startswith("did you mean runs/s?"), "resume: as given, too"
    with pytest.raises(HpcDdpError) as named:
        find_run("runs/s", Path("runs"))
    assert named.value.message == "runs/s is a sweep's folder, not a run's"
    assert named.value.hint.startswith("hpc-ddp sweep plot runs/s draws its tasks")
    with pytest.raises(HpcDdpError) as named:
        plot_sweep(sweep_dir, "val_acc", tmp_path / "s.png")
    assert named.value.message.endswith("'val_acc' (did you mean 'val_accuracy'?)")
    assert named.value.hint.endswith("its runs log: loss, val_accuracy")


def test_a_sweep_file_that_does_not_parse_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("name: s\ngrid:\n  --lr: [0.1, 0.2\n")
    assert cli_main(["sweep", "submit", str(sweep), "--", "tests/programs/regression.py"]) == 2
    error = capsys.readouterr().err
    assert "not valid YAML at line" in error and "Traceback" not in error


def test_a_sweep_is_not_submitted_into_another_sweeps_folder_or_a_folder_of_runs(
    tmp_path: Path,
) -> None:
    """Refused before Slurm is asked anything: no cluster needed."""
    from hpc_ddp.sweep.submit import submit_sweep

    spec = spec_from_dict({"name": "s", "grid": {"--lr": [1, 2]}}, "sweep.yaml")
    program = Program("script", "tests/programs/regression.py")
    request = RenderRequest(arguments=())
    manifest.create_manifest(tmp_path / "a" / "s", sweep_record(tmp_path, [{}, {}, {}]))
    with pytest.raises(HpcDdpError, match="already holds sweep 's' \\(3 tasks\\)") as refused:
        submit_sweep(spec, program, request, tmp_path / "a", {}, print)
    assert f"hpc-ddp sweep resume {tmp_path / 'a' / 's'}" in str(refused.value)
    (tmp_path / "b" / "s" / "task-1").mkdir(parents=True)
    with pytest.raises(HpcDdpError, match="holds runs that are not a sweep's"):
        submit_sweep(spec, program, request, tmp_path / "b", {}, print)
    assert not (tmp_path / "b" / "s" / "sweep.json").exists()


def train(lr: float, width: int = 8, *, steps: int) -> None:
    """A user's function to sweep (never called here)."""


def test_a_callables_keyword_arguments_are_its_option_keys_with_their_values_typed() -> None:
    from hpc_ddp.sweep.calls import keyword_arguments

    settings = {"--lr": "1e-05", "--batch-size": "3", "--fused": "true", "--opt": "adamw",
                "--decay": "null", "--name": "[1]", "run.seed": "7"}  # fmt: skip
    assert keyword_arguments(settings) == {
        "lr": 1e-05,
        "batch_size": 3,
        "fused": True,
        "opt": "adamw",
        "decay": None,
        "name": "[1]",  # a JSON list is not a scalar: kept as text
    }
    # A value written as a YAML or Python scalar reaches the callable as that value again;
    # from Python, strings that read as numbers, None and the infinities too.
    for value in (0.1, 1e-05, 3, 2**40, True, "adam", 1.5e300):
        (task,) = tasks_of({"list": [{"--x": value}]})
        assert keyword_arguments(task) == {"x": value}
    from hpc_ddp.sweep.calls import argument_text

    given = ["1", "true", "null", '"q"', "", "inf", None, float("inf"), -float("inf"), 0.5, "a b"]
    (task,) = tasks_of({"list": [{f"--x{i}": argument_text(v) for i, v in enumerate(given)}]})
    back = keyword_arguments(task)
    assert [back[f"x{i}"] for i in range(len(given))] == given
    assert type(back["x0"]) is str and type(back["x6"]) is type(None)


def test_a_task_whose_arguments_do_not_fit_the_callable_is_refused_before_submitting() -> None:
    from hpc_ddp.sweep.calls import CallableProgram, check_calls

    program = CallableProgram(train, {"steps": 5})
    check_calls(program, [{"--lr": "0.1"}, {"--lr": "0.2", "--width": "4", "run.seed": "1"}])
    with pytest.raises(HpcDdpError, match=r"task 1 \(lr=0.1 momentum=0.9\) cannot call "
                       r".*train\(lr, width=8, \*, steps\).*momentum"):  # fmt: skip
        check_calls(program, [{"--lr": "0.1"}, {"--lr": "0.1", "--momentum": "0.9"}])
    with pytest.raises(HpcDdpError, match=r"task 0 \(width=4\).*missing a required argument: 'lr'"):
        check_calls(program, [{"--width": "4"}])
    with pytest.raises(HpcDdpError, match="the sweep sets steps, which kwargs= also sets"):
        check_calls(program, [{"--lr": "1", "--steps": "3"}])
    # A resume's --set may replace what kwargs= gave.
    check_calls(program, [{"--lr": "1", "--steps": "3"}], overriding=True)


def test_a_callable_that_cannot_travel_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    import threading

    from hpc_ddp.sweep.calls import CallableProgram
    from hpc_ddp.sweep.submit import submit_sweep

    spec = spec_from_dict({"name": "s", "grid": {"--lr": [1, 2]}}, "sweep.yaml")
    program = CallableProgram(train, {"steps": threading.Lock()})
    with pytest.raises(HpcDdpError, match="cannot be pickled") as refused:
        submit_sweep(spec, program, RenderRequest(arguments=()), tmp_path, {}, print)
    assert "plain data" in str(refused.value)
    assert not (tmp_path / "s").exists()


def test_the_python_form_takes_plain_keys_as_options_and_refuses_kwargs_for_a_script() -> None:
    import hpc_ddp

    with pytest.raises(HpcDdpError, match="kwargs= applies to a callable"):
        hpc_ddp.submit_sweep("train.py", name="s", kwargs={"a": 1}, grid={"lr": [1]})
    with pytest.raises(HpcDdpError, match="task 0 \\(lr=1 depth=2\\) cannot call"):
        hpc_ddp.submit_sweep(train, name="s", grid={"lr": [1], "--depth": [2]})


@pytest.mark.e2e
def test_a_sweeps_results_are_what_rank_0_of_each_task_returned(tmp_path: Path) -> None:
    import cloudpickle

    import hpc_ddp
    from hpc_ddp.sweep.calls import RESULT_FILE

    data = sweep_record(tmp_path, [{}, {}, {}, {}])
    for task, state in zip(data["tasks"], ["finished"] * 3 + ["running"], strict=True):
        task["state"] = state
    manifest.create_manifest(tmp_path / "s", data)
    for index, value in ((0, {"loss": 0.5}), (2, [1, 2]), (3, "an earlier attempt's")):
        run_dir = manifest.run_dir_of(data, data["tasks"][index])
        run_dir.mkdir(parents=True)
        (run_dir / RESULT_FILE).write_bytes(cloudpickle.dumps(value))
    sweep = hpc_ddp.Sweep(str(tmp_path / "s"))  # a path as text, as users type it
    assert sweep.results() == [{"loss": 0.5}, None, [1, 2], None], "only finished tasks'"
    assert [row.state for row in sweep.status()][:3] == ["finished"] * 3


def test_code_sent_by_value_gets_its_file_back_for_tracebacks(tmp_path: Path) -> None:
    """cloudpickle 3.1.3 names the file of code it sends by value ``<dynamic-code>``: the
    function, a helper and a class's method of the user's script get their file back."""
    import traceback

    from hpc_ddp.sweep.calls import DYNAMIC_CODE, restore_file_names

    script = tmp_path / "sweep_fn.py"
    source = (
        "class Scale:\n"
        "    @staticmethod\n"
        "    def of(x):\n"
        "        raise ValueError(x)\n"
        "def helper(x):\n"
        "    return Scale.of(x)\n"
        "def train(lr):\n"
        "    return helper(lr)\n"
    )
    script.write_text(source)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(source, DYNAMIC_CODE, "exec"), namespace)
    restore_file_names(namespace["train"], str(script))
    with pytest.raises(ValueError) as raised:
        namespace["train"](0.1)
    frames = traceback.extract_tb(raised.tb)[-3:]
    assert [(frame.filename, frame.lineno, frame.name) for frame in frames] == [
        (str(script), 8, "train"),
        (str(script), 6, "helper"),
        (str(script), 4, "of"),
    ]
    assert frames[-1].line == "raise ValueError(x)", "the source line is found again"


def test_the_python_form_checks_a_sweep_of_the_built_in_trainer_against_its_settings(
    tmp_path: Path,
) -> None:
    """The sweep launcher knows no trainer: ``hpc_ddp.submit_sweep`` tells it the trainer's
    settings, so a misspelt one is refused before anything is written, and a right one
    passes that check (to be refused by the next one, before Slurm is asked)."""
    import hpc_ddp

    with pytest.raises(
        HpcDdpError, match=r"(?s)not a setting of the built-in trainer.*did you mean optim\.lr\?"
    ):
        hpc_ddp.submit_sweep(
            "--config digits", name="s", grid={"optim.lrate": [1]}, output_dir=tmp_path
        )
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(HpcDdpError, match=r"command line sets optim\.lr, which the sweep sets"):
        hpc_ddp.submit_sweep(
            "--config digits optim.lr=0.5", name="s", grid={"optim.lr": [1]}, output_dir=tmp_path
        )
    assert list(tmp_path.iterdir()) == []
    assert "trainer_settings" not in inspect.signature(hpc_ddp.submit_sweep).parameters
    assert "trainer_settings" not in (hpc_ddp.submit_sweep.__doc__ or "trainer_settings")
    assert "concurrency" in inspect.signature(hpc_ddp.submit_sweep).parameters


@pytest.mark.parametrize("values", ["0.1,0.01", 0.1], ids=["string", "number"])
def test_a_grid_of_one_string_is_refused_not_swept_as_one_value(
    values: Any, tmp_path: Path
) -> None:
    """grid={"lr": "0.1,0.01"} would be one task given --lr 0.1,0.01: refused before
    anything is written or submitted."""
    import hpc_ddp
    from hpc_ddp.runtime.errors import HpcDdpError

    with pytest.raises(HpcDdpError, match=r"grid=\{'lr': .*expected a list of values"):
        hpc_ddp.submit_sweep("train.py", name="lr", grid={"lr": values}, output_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        ({"grid": {"--lr": [0.1, 0.1, 1]}}, "grid.--lr: '0.1' listed more than once"),
        ({"zip": {"--lr": [1, 1], "--bs": [8, 8]}}, "zip: row 1 (--lr=1, --bs=8) is row 0 again"),
        ({"list": [{"--lr": 1}, {"--lr": 1}]}, "list[1]: the same settings as list[0]"),
        ({"grid": {"--tag": ["a\x1b[2Jb"]}}, "holds the character U+001B"),
        ({"grid": {"--tag": ["a\x0bb"]}}, "holds the character U+000B"),
        ({"grid": {"--tag": ["\u202eexe.txt"]}}, "holds the character U+202E"),
        ({"grid": {"preempt.signal": ["USR1", "USR2"]}}, "goes into the one job script"),
    ],
    ids=["grid", "zip", "list", "escape", "vertical-tab", "bidi", "signal"],
)
def test_a_sweep_that_would_run_a_task_twice_or_print_a_control_is_refused(
    raw: dict[str, Any], said: str
) -> None:
    with pytest.raises(HpcDdpError, match=re.escape(said)):
        tasks_of(raw)


def test_zip_rows_may_share_a_value_when_the_rows_differ() -> None:
    assert tasks_of({"zip": {"--lr": [1, 1], "--bs": [8, 16]}}) == [
        {"--lr": "1", "--bs": "8"},
        {"--lr": "1", "--bs": "16"},
    ]


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda data: data["tasks"].append({}), "tasks[2].index holds NoneType"),
        (lambda data: data.update(tasks="task-000"), "tasks holds str 'task-000'"),
        (lambda data: data["tasks"][1].update(state="exploded"), "tasks[1].state is 'exploded'"),
        (lambda data: data["tasks"][1].update(index=7), "tasks[1].index is 7, at position 1"),
        (
            lambda data: data["tasks"][0].update(settings={"--lr": 1}),
            "tasks[0].settings holds a value that",
        ),
        (lambda data: data["tasks"][0].update(final=[1]), "tasks[0].final holds list"),
        (lambda data: data.update(arrays={"a": 1}), "arrays holds dict"),
    ],
    ids=["empty-task", "tasks-text", "state", "index", "settings", "final", "arrays"],
)
def test_sweep_status_of_a_damaged_record_is_one_line_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: Any, said: str
) -> None:
    data = sweep_record(tmp_path, [{"--lr": "0.1"}, {"--lr": "0.2"}])
    damage(data)
    manifest.write_manifest(tmp_path, {"format": manifest.FORMAT, **data})
    assert cli_main(["sweep", "status", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert f"sweep.json is damaged: {said}" in error and "Traceback" not in error, error
