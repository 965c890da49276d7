"""End-to-end on the real test Slurm cluster (make cluster-up): sbatch, salloc+srun, torchrun,
fail-fast launches and the GPU GRES mapping.

The nodes have GPU GRES backed by stand-in device files (a GPU cannot exist here): Slurm
allocates them and sets CUDA_VISIBLE_DEVICES exactly as on a GPU node, while torch sees no
CUDA device and trains on gloo. A second physical host cannot exist either: node1 and node2
are two slurmd daemons on this machine, reached on 127.0.0.1.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from mlflow import MlflowClient

from hpc_ddp.runtime.tracking.base import default_tracking_uri
from tests.helpers import REPO, read_summary, run_local, summary_path
from tests.slurm_cluster import SlurmCluster, prepare_workdir

pytestmark = pytest.mark.slurm
TRAIN = str(REPO / "slurm" / "train.sh")
TORCHRUN = str(REPO / "slurm" / "train-torchrun.sh")
SMALL = ["data.num_samples=3072", "data.batch_size=96", "train.epochs=2", "train.log_interval=4"]


def doctor_reports(json_dir: Path) -> list[dict[str, Any]]:
    """The reports ``hpc-ddp doctor --json-dir`` wrote, in rank order."""
    reports = [json.loads(path.read_text()) for path in json_dir.glob("doctor-rank-*.json")]
    return sorted(reports, key=lambda report: report.get("rank", -1))


def doctor_in_allocation(
    slurm: SlurmCluster, work: Path, allocation: list[str], settings: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    """``hpc-ddp doctor`` for the digits config on CUDA, in every task of an allocation that
    salloc makes with the options ``allocation``; the reports go to ``work/doctor``. The
    checks before the first step are off: the nodes' GPUs are stand-ins no product runs on."""
    return slurm.run(
        ["salloc", *allocation, "srun", "python", "-m", "hpc_ddp", "doctor",
         "--json-dir", str(work / "doctor"), "--config", "configs/digits.yaml",
         "dist.device=cuda", "checks.enabled=false", *settings],
        work,
        timeout=120,
    )  # fmt: skip


def test_sbatch_one_node_two_tasks(slurm: SlurmCluster, tmp_path: Path) -> None:
    work = prepare_workdir(tmp_path)
    job = slurm.sbatch(
        [
            "--nodes=1",
            "--ntasks-per-node=2",
            TRAIN,
            "configs/synthetic.yaml",
            f"run.output_dir={work / 'runs'}",
            *SMALL,
        ],
        work,
    )
    state = slurm.wait(job)
    log = (work / f"hpc-ddp-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    summary = read_summary(work / "runs")
    assert (
        summary["world_size"] == 2 and summary["launcher"] == "slurm" and summary["job_id"] == job
    )
    assert summary_path(work / "runs").parent.name == job
    assert "[rank 0/2]" in log and "[rank 1/2]" in log and "steps on 2 rank(s)" in log
    # Nothing printed once per rank beyond its start line (a log of 4,096 ranks stays short):
    # the template sets no deprecated torch variable that every rank would warn about.
    assert "is deprecated" not in log, [line for line in log.splitlines() if "deprecated" in line]
    summary_timings = summary["timeline_ranks"]["latest"]
    assert summary_timings["first_step_unix"] >= summary_timings["entry_unix"]
    assert set(summary["ending_s"]) == {"final_checkpoint", "summary", "close"}
    assert summary["open_sockets"] > 0 and summary["peak_rss_mib"] > 50
    client = MlflowClient(tracking_uri=default_tracking_uri(work / "runs"))
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string=f"tags.`hpc_ddp.job_id` = '{job}'",
    )
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.tags["hpc_ddp.launcher"] == "slurm"


def test_sbatch_two_nodes_matches_four_local_ranks(slurm: SlurmCluster, tmp_path: Path) -> None:
    work = prepare_workdir(tmp_path / "slurm")
    job = slurm.sbatch(
        [
            "--nodes=2",
            "--ntasks-per-node=2",
            TRAIN,
            "configs/synthetic.yaml",
            f"run.output_dir={work / 'runs'}",
            "tracking.enabled=false",
            *SMALL,
        ],
        work,
    )
    state = slurm.wait(job)
    log = (work / f"hpc-ddp-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    summary = read_summary(work / "runs")
    assert summary["world_size"] == 4 and summary["num_nodes"] == 2
    nodes = set(re.findall(r"\[rank \d/4\] INFO host \S+ node (\d)/2", log))
    assert nodes == {"0", "1"}
    assert re.search(r"master node1:\d+", log), "MASTER_ADDR is the first node"

    local_runs = tmp_path / "local"
    result = run_local(4, local_runs, ["tracking.enabled=false", *SMALL])
    assert result.returncode == 0, result.stderr[-2000:]
    local = read_summary(local_runs)
    if local["weights_sha256"] != summary["weights_sha256"]:
        expected = torch.load(summary_path(local_runs).parent / "model.pt", weights_only=True)
        actual = torch.load(summary_path(work / "runs").parent / "model.pt", weights_only=True)
        for key in expected:
            torch.testing.assert_close(actual[key], expected[key], rtol=1e-5, atol=1e-6)
    assert local["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-5)


def test_salloc_then_srun(slurm: SlurmCluster, tmp_path: Path) -> None:
    work = prepare_workdir(tmp_path)
    result = slurm.run(
        [
            "salloc",
            "--nodes=1",
            "--ntasks=2",
            "srun",
            "--kill-on-bad-exit=1",
            "python",
            "-m",
            "hpc_ddp.train",
            "--config",
            "configs/synthetic.yaml",
            f"run.output_dir={work / 'runs'}",
            "tracking.enabled=false",
            *SMALL,
        ],
        work,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_summary(work / "runs")
    assert summary["world_size"] == 2 and summary["launcher"] == "slurm"


def test_torchrun_template_two_nodes(slurm: SlurmCluster, tmp_path: Path) -> None:
    work = prepare_workdir(tmp_path)
    job = slurm.sbatch(
        [
            "--nodes=2",
            TORCHRUN,
            "configs/synthetic.yaml",
            f"run.output_dir={work / 'runs'}",
            "tracking.enabled=false",
            *SMALL,
        ],
        work,
    )
    state = slurm.wait(job, timeout=240)
    log = (work / f"hpc-ddp-torchrun-{job}.out").read_text()
    assert state == "COMPLETED", log[-4000:]
    summary = read_summary(work / "runs")
    assert summary["world_size"] == 4 and summary["launcher"] == "torchelastic"
    assert summary["job_id"] == job and summary["num_nodes"] == 2


def test_python_without_srun_in_a_two_task_job_is_refused_before_any_rendezvous(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    work = prepare_workdir(tmp_path)
    script = work / "wrong.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --output=wrong-%j.out\n"
        "python -m hpc_ddp.train --config configs/synthetic.yaml\n"
    )
    job = slurm.sbatch([str(script)], work)
    state = slurm.wait(job, timeout=300)  # the refusal, not this bound, is the verdict
    log = (work / f"wrong-{job}.out").read_text()
    assert state == "FAILED"
    assert "not started by srun" in log and "HINT: start training with `srun" in log
    assert "rendezvous" not in log, "refused before any rank waited for the others"


def test_doctor_shows_each_rank_and_its_gpu_per_task(slurm: SlurmCluster, tmp_path: Path) -> None:
    work = prepare_workdir(tmp_path)
    result = doctor_in_allocation(
        slurm, work, ["--nodes=2", "--ntasks-per-node=2", "--gpus-per-task=1"]
    )
    reports = doctor_reports(work / "doctor")
    assert result.returncode == 0, result.stdout + result.stderr
    assert [r["rank"] for r in reports] == [0, 1, 2, 3]
    assert [r["node_rank"] for r in reports] == [0, 0, 1, 1]
    assert [r["local_rank"] for r in reports] == [0, 1, 0, 1]
    assert [r["cuda_visible_devices"] for r in reports] == ["0", "1", "0", "1"]
    assert {r["device"] for r in reports} == {"cuda:0"}, "each task drives its own GPU as cuda:0"
    assert {r["backend"] for r in reports} == {"nccl"}
    assert {r["master_addr"] for r in reports} == {"node1"}
    assert len({r["master_port"] for r in reports}) == 1
    assert {r["per_rank_batch"] for r in reports} == {16}
    assert all(r["ok"] for r in reports)
    warnings = [text for r in reports for status, text in r["checks"] if status == "warn"]
    assert len(warnings) == 4 and "sees only its own GPU" in warnings[0], warnings


#: A run directory 5 KB long: each rank's plan, and its report, pass 4 KB.
LONG_PATH = "x/" * 2500


def test_doctor_reports_of_four_tasks_arrive_whole_however_long(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """srun passes a task's output on in pieces of 1 KB: doctor prints lines of at most 1 KB,
    each labelled with its rank, and the whole report goes to a file per rank."""
    work = prepare_workdir(tmp_path)
    result = doctor_in_allocation(
        slurm,
        work,
        ["--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=2"],
        [f"run.output_dir={work / LONG_PATH}"],
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    reports = doctor_reports(work / "doctor")
    assert [r["rank"] for r in reports] == [0, 1, 2, 3]
    assert all(LONG_PATH in r["plan"] for r in reports), "each report whole in its file"
    lines = result.stdout.splitlines()
    assert max(len(line.encode()) for line in lines) <= 1000
    for rank in range(4):
        label = f"[doctor rank {rank}/4] "
        own = [line.removeprefix(label) for line in lines if line.startswith(label)]
        plan = own[0] + "".join(piece.removeprefix("... ") for piece in own[1:6])
        assert LONG_PATH in plan and own[6].startswith("ok "), own[:8]
    assert all(line.count("[doctor rank ") == 1 for line in lines), "no line holds two ranks'"


def test_long_lines_from_four_tasks_arrive_labelled_never_cut_into_each_other(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """A script's 5 KB lines, printed by 4 tasks at once under the sbatch template: srun
    labels each piece with its task, so each task's lines read back whole, in order."""
    work = prepare_workdir(tmp_path)
    (work / "barrier").mkdir()
    program = [
        str(REPO / "tests" / "programs" / "long_lines.py"),
        str(work / "barrier"),
        "5",
        "5000",
    ]
    job = slurm.sbatch(["--nodes=2", "--ntasks-per-node=2", TRAIN, *program], work)
    state = slurm.wait(job)
    log = (work / f"hpc-ddp-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    pieces: dict[int, list[str]] = {rank: [] for rank in range(4)}
    for line in log.splitlines():
        labelled = re.fullmatch(r" *(\d+): (.*)", line)
        if labelled:
            pieces[int(labelled[1])].append(labelled[2])
    for rank, own in pieces.items():
        expected = "".join(f"R{rank}-{i}:{str(rank) * 5000}:END{rank}-{i}" for i in range(5))
        assert expected in "".join(own), f"rank {rank}'s lines, from {len(own)} pieces"
        others = [f"R{other}-" for other in range(4) if other != rank]
        assert not [piece for piece in own if any(mark in piece for mark in others)]


def test_the_template_gives_each_task_its_nodes_gpus(slurm: SlurmCluster, tmp_path: Path) -> None:
    """`sbatch slurm/train.sh` on 2 nodes with GPU GRES: every task sees both GPUs of its node
    and drives cuda:LOCAL_RANK, so NCCL could use CUDA IPC between them.

    torch here cannot open a CUDA device, so $PYTHON (which the template runs) is a stand-in
    that runs `hpc_ddp doctor` on the training command's arguments: the same plan, no NCCL.
    """
    work = prepare_workdir(tmp_path)
    stand_in = work / "python-doctor"
    stand_in.write_text(  # the templates' shared body is found with the real python
        f'#!/bin/bash\n[[ $2 == hpc_ddp.launch.templates ]] && exec {sys.executable} "$@"\n'
        f"[[ $1 == -m && $2 == hpc_ddp.train ]] || exit 9\nshift 2\n"
        f'exec {sys.executable} -m hpc_ddp doctor --json-dir {work / "doctor"} "$@"\n'
    )
    stand_in.chmod(0o755)
    result = slurm.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=2",
            TRAIN,
            "configs/digits.yaml",
            "dist.device=cuda",
            "checks.enabled=false",
        ],
        work,
        PYTHON=str(stand_in),
    )
    assert result.returncode == 0, result.stderr
    job = result.stdout.strip().split(";")[0]
    state = slurm.wait(job)
    log = (work / f"hpc-ddp-{job}.out").read_text()
    assert state == "COMPLETED", log[-3000:]
    reports = doctor_reports(work / "doctor")
    assert [r["rank"] for r in reports] == [0, 1, 2, 3], log[-3000:]
    assert [r["cuda_visible_devices"] for r in reports] == ["0,1"] * 4
    assert [r["device"] for r in reports] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert [r["node_rank"] for r in reports] == [0, 0, 1, 1]
    assert {r["backend"] for r in reports} == {"nccl"}
    assert not [text for r in reports for status, text in r["checks"] if status != "ok"]


def test_doctor_with_gres_uses_local_rank(slurm: SlurmCluster, tmp_path: Path) -> None:
    work = prepare_workdir(tmp_path)
    result = doctor_in_allocation(slurm, work, ["--nodes=1", "--ntasks-per-node=2", "--gres=gpu:2"])
    reports = doctor_reports(work / "doctor")
    assert result.returncode == 0, result.stdout + result.stderr
    assert [r["cuda_visible_devices"] for r in reports] == ["0,1", "0,1"]
    assert [r["device"] for r in reports] == ["cuda:0", "cuda:1"]


@pytest.mark.parametrize(
    "layout",
    [["--ntasks-per-node=1", "--gpus-per-node=2"], ["--ntasks-per-node=1", "--gpus-per-task=2"]],
    ids=["gpus-per-node", "gpus-per-task"],
)
def test_a_rank_over_two_gpus_gets_both_in_either_layout(
    layout: list[str], slurm: SlurmCluster, tmp_path: Path
) -> None:
    """dist.gpus_per_rank=2 on 2 nodes of 2 GRES GPUs: one rank per node drives both."""
    work = prepare_workdir(tmp_path)
    result = doctor_in_allocation(slurm, work, ["--nodes=2", *layout], ["dist.gpus_per_rank=2"])
    reports = doctor_reports(work / "doctor")
    assert result.returncode == 0, result.stdout + result.stderr
    assert [r["rank"] for r in reports] == [0, 1]
    assert [r["cuda_visible_devices"] for r in reports] == ["0,1", "0,1"]
    assert [r["devices"] for r in reports] == [["cuda:0", "cuda:1"]] * 2
    if "--gpus-per-task=2" in layout:
        assert "--gpus-per-task=2" in reports[0]["plan"]


def test_two_ranks_per_node_cannot_have_two_gpus_each_from_two(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    work = prepare_workdir(tmp_path)
    result = doctor_in_allocation(
        slurm,
        work,
        ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=2"],
        ["dist.gpus_per_rank=2"],
    )
    assert result.returncode != 0
    assert "dist.gpus_per_rank=2 need 4 GPUs, but 2 are visible" in result.stdout
    assert "HINT: request --gpus-per-node=4 with --ntasks-per-node=2" in result.stdout


def test_more_tasks_than_gpus_fails_before_any_process_group(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    work = prepare_workdir(tmp_path)
    result = slurm.run(
        [
            "salloc",
            "--nodes=1",
            "--ntasks-per-node=2",
            "--gres=gpu:1",
            "srun",
            "python",
            "-m",
            "hpc_ddp.train",
            "--config",
            "configs/digits.yaml",
            "dist.device=cuda",
        ],
        work,
        timeout=120,
    )
    assert result.returncode != 0
    assert "2 tasks on node" in result.stderr and "only 1 visible GPU" in result.stderr
    assert "HINT: run one task per GPU" in result.stderr


def test_training_in_an_interactive_pty_shell_fails_fast(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """`srun --pty` inside a 2-task allocation; `script` gives srun the terminal it needs."""
    work = prepare_workdir(tmp_path)
    result = slurm.run(
        [
            "salloc",
            "--ntasks=2",
            "script",
            "-qec",
            "srun --ntasks=1 --pty python -m hpc_ddp.train --config configs/digits.yaml",
            "/dev/null",
        ],
        work,
        timeout=120,
    )
    assert result.returncode != 0
    assert "interactive `srun --pty` shell" in result.stdout
    assert "inside Slurm job" in result.stdout and "of 2 tasks" in result.stdout
    assert "HINT: from this shell run `srun --overlap --ntasks=2" in result.stdout


def test_a_node_failing_the_sites_health_check_is_left_out_and_the_job_requeued(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """checks.command runs once on each node of a 2-node job; it fails on the allocation's
    last node whenever that node is in the job. The attempt stops before any step, names the
    node (by Slurm's name, which --exclude takes) with the command's output, leaves it out of
    the job (ExcNodeList) and requeues; the next attempt runs on the other two and ends with
    the weights of a run that never met the bad node."""
    work = prepare_workdir(tmp_path)
    health, bad = work / "health.sh", work / "bad-node"
    # The first attempt picks its last node as the bad one, the same on every node.
    health.write_text(
        f"#!/bin/sh\nif [ ! -f {bad} ]; then\n"
        f'  scontrol show hostnames "$SLURM_JOB_NODELIST" | tail -n 1 > {bad}.$$ && '
        f"mv {bad}.$$ {bad}\nfi\n"
        f'if [ "$SLURMD_NODENAME" = "$(cat {bad})" ]; then\n'
        '  echo "ECC errors on GPU 1"; exit 1\nfi\n'
    )
    job = slurm.sbatch(
        ["--nodes=2", "--ntasks-per-node=1", TRAIN, "configs/synthetic.yaml",
         f"run.output_dir={work / 'runs'}", f"checks.command=sh {health}",
         "tracking.enabled=false", *SMALL],
        work,
    )  # fmt: skip
    state = slurm.wait(job, timeout=300)
    log = (work / f"hpc-ddp-{job}.out").read_text()
    assert state == "COMPLETED", (state, log[-3000:])
    node = bad.read_text().strip()
    assert f"{node} (rank 1): checks.command: `sh {health}` exited with 1: ECC errors on GPU 1" in (
        log
    ), log[-3000:]
    assert f"left {node} out of job {job} (ExcNodeList: {node}) and requeued it" in log
    assert "node failure 1 of preempt.max_node_failures=2" in log
    assert slurm.job_field(job, "ExcNodeList") == node and slurm.job_field(job, "Restarts") == "1"
    ran_on = slurm.run(["scontrol", "show", "hostnames", slurm.job_field(job, "NodeList")], work)
    assert node not in ran_on.stdout.split() and len(ran_on.stdout.split()) == 2
    run_dir = next((work / "runs").glob(f"*/{job}"))
    failures = json.loads((run_dir / "excluded_hosts.json").read_text())
    assert [(f["job"], f["hosts"], f["restart_count"], f["requeued"]) for f in failures] == [
        (job, [node], 0, True)
    ]
    assert json.loads((run_dir / "checks.json").read_text())["passed"], "the second attempt's"
    listed = slurm.run([sys.executable, "-m", "hpc_ddp", "runs", str(work / "runs")], work)
    shown = f"synthetic-mlp/{job}: job {job} attempt 0: {node} failed the checks ({node} (rank 1)"
    assert shown in listed.stdout and "left out, the job requeued" in listed.stdout, listed.stdout
    summary = read_summary(work / "runs")
    assert (summary["restart_count"], summary["resumed_from_step"]) == (1, None)
    reference = run_local(2, tmp_path / "reference", [*SMALL, "tracking.enabled=false"])
    assert reference.returncode == 0, reference.stderr[-2000:]
    assert summary["weights_sha256"] == read_summary(tmp_path / "reference")["weights_sha256"]
