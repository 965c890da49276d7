"""Real multi-process DDP training on local CPU ranks (gloo on 127.0.0.1).

Every run goes through `hpc-ddp local`, the same entry point Slurm starts.
"""

from __future__ import annotations

import math
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from hpc_ddp.launch.local import is_stopped
from hpc_ddp.launch.rank_exits import PEER_GRACE_S, failure_line, failure_to_report
from hpc_ddp.runtime.errors import EXIT_PEER_LOST, EXIT_STOPPED, HpcDdpError, lost_peer
from hpc_ddp.runtime.loop.metrics import PENDING_MAX, Sums
from hpc_ddp.runtime.loop.replicas import replica_entries, replica_fingerprint
from hpc_ddp.runtime.monitor.system import metric_part
from hpc_ddp.runtime.preempt.liveness import STORE_TIMEOUT_S
from hpc_ddp.runtime.preempt.stall_report import OUTPUT_TURN_WAIT_S
from hpc_ddp.runtime.preempt.watchdog import ENDING_GRACE_S
from hpc_ddp.runtime.session.evaluation import ShardedEvalSampler
from hpc_ddp.runtime.tracking.record import read_metrics
from hpc_ddp.trainer.schedule import LrSchedule, lr_factor
from tests.helpers import (
    REPO,
    clean_environ,
    read_summary,
    run_local,
    run_local_program,
    run_train,
    summary_path,
)

EXACT = [
    "train.max_steps=20",
    "train.epochs=1",
    "data.batch_size=96",
    "data.num_samples=2400",
    "data.num_val_samples=1001",
    "tracking.enabled=false",
    "train.log_interval=5",
]


@pytest.fixture(scope="module")
def equivalence_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same global batch of 96 at world sizes 1, 2 and 3, and W=1 with accumulation."""
    runs = {
        "w1": (1, []),
        "w2": (2, []),
        "w3": (3, []),
        "w1_accum2": (1, ["train.grad_accum_steps=2"]),
        "w2_train_accuracy": (2, ["train.train_accuracy=true"]),
    }
    outputs = {}
    for name, (nproc, extra) in runs.items():
        output = tmp_path_factory.mktemp(name)
        result = run_local(nproc, output, EXACT + extra)
        assert result.returncode == 0, result.stderr[-3000:]
        outputs[name] = output
    return outputs


def weights(output: Path) -> dict[str, torch.Tensor]:
    return torch.load(summary_path(output).parent / "model.pt", weights_only=True)  # type: ignore[no-any-return]


@pytest.mark.e2e
def test_every_world_size_sees_each_validation_sample_exactly_once(equivalence_runs) -> None:
    summaries = {name: read_summary(path) for name, path in equivalence_runs.items()}
    for name, summary in summaries.items():
        assert summary["val_samples"] == 1001, name
        assert summary["global_step"] == 20 and summary["samples_seen"] == 20 * 96
    assert [summaries[n]["world_size"] for n in ("w1", "w2", "w3")] == [1, 2, 3]
    reference = summaries["w1"]["val_loss"]
    for name in ("w2", "w3", "w1_accum2"):
        assert summaries[name]["val_loss"] == pytest.approx(reference, rel=1e-5), name
        assert summaries[name]["val_accuracy"] == pytest.approx(summaries["w1"]["val_accuracy"])
        assert summaries[name]["train_loss"] == pytest.approx(
            summaries["w1"]["train_loss"], rel=1e-5
        )


@pytest.mark.e2e
def test_w1_and_w2_give_the_same_final_weights(equivalence_runs) -> None:
    reference = weights(equivalence_runs["w1"])
    for name in ("w2", "w3", "w1_accum2"):
        other = weights(equivalence_runs[name])
        assert reference.keys() == other.keys()
        for key in reference:
            torch.testing.assert_close(
                other[key], reference[key], rtol=1e-5, atol=1e-6, msg=f"{name}:{key}"
            )
    initial = torch.nn.Linear(64, 256)
    assert not torch.allclose(reference["layers.0.weight"][:, :64], initial.weight), "weights moved"


@pytest.mark.e2e
def test_train_accuracy_is_counted_only_when_asked_and_changes_no_weight(
    equivalence_runs,
) -> None:
    counted = read_summary(equivalence_runs["w2_train_accuracy"])
    assert 0.0 < counted["train_accuracy"] <= 1.0
    assert read_summary(equivalence_runs["w2"])["train_accuracy"] is None
    plain, with_accuracy = (
        weights(equivalence_runs["w2"]),
        weights(equivalence_runs["w2_train_accuracy"]),
    )
    for key in plain:
        assert torch.equal(plain[key], with_accuracy[key]), key


@pytest.mark.e2e
def test_digits_learns_on_two_ranks_and_reports_progress(tmp_path: Path) -> None:
    result = run_local(
        2, tmp_path, ["train.epochs=6", "tracking.enabled=false"], config="configs/digits.yaml"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_summary(tmp_path)
    assert summary["world_size"] == 2 and summary["launcher"] == "local"
    assert summary["val_samples"] == 359
    assert summary["val_accuracy"] > 0.85
    assert len(summary["weights_sha256"]) == 64
    assert summary["replicas_in_sync"] is True and summary["replicas_diverged_at"] is None
    assert "replicas differ" not in result.stderr
    ends = re.findall(r"epoch (\d+) ended: train_loss ([0-9.e-]+)", result.stderr)
    epoch_losses = [float(loss) for _epoch, loss in ends]
    assert len(epoch_losses) == 6 and epoch_losses[-1] < epoch_losses[0] / 2
    in_progress = {int(n) for n in re.findall(r"INFO epoch (\d+) step \d+/", result.stderr)}
    assert [int(epoch) for epoch, _loss in ends] == sorted(in_progress) == list(range(6)), (
        "an epoch has one number in its progress lines and at its end"
    )
    assert "[rank 0/2]" in result.stderr
    assert "[rank 1/2] INFO epoch" not in result.stderr, "progress comes from rank 0 only"
    assert re.search(r"samples/s", result.stderr)
    period = re.search(r"stop signals are checked every (\d+) step", result.stderr)
    assert period and 1 <= int(period.group(1)) <= 1000


@pytest.mark.e2e
def test_bf16_and_three_ranks_with_workers(tmp_path: Path) -> None:
    result = run_local(
        3,
        tmp_path,
        [
            "train.precision=bf16",
            "data.batch_size=96",
            "data.num_workers=1",
            "train.max_steps=12",
            "train.log_interval=4",
            "tracking.enabled=false",
            "optim.schedule=cosine",
            "optim.warmup_steps=3",
            "monitor.tokens_per_sample=10",
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_summary(tmp_path)
    assert summary["world_size"] == 3 and summary["val_samples"] == 1001
    # The run's rates, both from its stated training time: equal but for their rounding
    # to 0.1 (samples/s, times 10 tokens) and 0.1 (tokens/s).
    assert summary["tokens_per_s"] == pytest.approx(10 * summary["samples_per_s"], abs=0.55)
    assert math.isfinite(summary["val_loss"]) and summary["global_step"] == 12
    # The machine's side, recorded per host: the CPU and memory of 3 ranks and their
    # workers; on CPU no GPU metrics, said once.
    assert result.stderr.count("no GPU metrics (the run is on CPU)") == 1, result.stderr[-3000:]
    logged = [entry["metrics"] for entry in read_metrics(summary_path(tmp_path).parent)]
    system = [{name: value for name, value in metrics.items() if name.startswith("system/")}
              for metrics in logged if "interval/samples_per_s" in metrics]  # fmt: skip
    host = metric_part(socket.gethostname())
    expected = {f"system/{host}/cpu_percent", f"system/{host}/memory_mib"}
    assert len(system) == 3 and all(set(metrics) == expected for metrics in system), system
    # Three processes that imported torch, and their workers (PSS: shared pages split).
    assert all(100 < metrics[f"system/{host}/memory_mib"] < 64 * 1024 for metrics in system)
    # Where each interval's time went: the parts are shares of it, the forward timed on
    # every rank (the built-in trainer's model is wrapped by run.wrap), and the FLOPs of its
    # model counted once on the meta device, so the TFLOP/s need no setting.
    intervals = [metrics for metrics in logged if "interval/samples_per_s" in metrics]
    for metrics in intervals:
        parts = ("data_wait", "forward", "optimizer", "stop_agreement", "checkpoint", "evaluation")
        for part in parts:
            assert 0 <= metrics[f"interval/{part}_percent"] <= 100, metrics
        assert metrics["interval/forward_percent"] > 0
        assert metrics["interval/slowest_rank"] in (0.0, 1.0, 2.0)
        assert metrics["interval/slowest_rank_ratio"] >= 1
        assert metrics["interval/tflops"] > 0 and "interval/mfu_percent" not in metrics
    assert result.stderr.count("and its backward is") == 1


@pytest.mark.e2e
def test_failed_rank_ends_the_job_fast_naming_it(tmp_path: Path) -> None:
    """Rank 0 would wait dist.timeout_s (600 s) for the rank that raised: the job ends at
    once instead (well inside run_local's 240 s), naming the rank."""
    result = run_local(
        2,
        tmp_path,
        [
            "model.kind=custom",
            "model.factory=tests.factories:failing_model",
            "tracking.enabled=false",
        ],
    )
    assert result.returncode == 1
    assert "injected failure on rank 1" in result.stderr
    assert "rank 1 exited with code 1; stopping the other ranks" in result.stderr, (
        "the rank that raised is named, not rank 0 whose collective lost it"
    )
    assert "[rank 0] failed:" not in result.stderr, "rank 0 is a consequence, not a crash"


@pytest.mark.e2e
def test_a_stopped_process_is_seen_stopped_until_it_continues() -> None:
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        assert not is_stopped(sleeper.pid)
        sleeper.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while not is_stopped(sleeper.pid):  # the kernel stops it after kill() returns
            assert time.monotonic() < deadline, "the kernel did not stop `sleep` within 30 s"
            time.sleep(0.01)
        sleeper.send_signal(signal.SIGCONT)
        while is_stopped(sleeper.pid):
            assert time.monotonic() < deadline + 30, "`sleep` did not continue within 30 s"
            time.sleep(0.01)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not is_stopped(sleeper.pid), "no such process: not stopped"


def test_the_rank_that_went_away_is_named_not_the_one_that_lost_it() -> None:
    """Exit codes as ranks report them (None: still running); 4 = lost a peer."""
    assert failure_to_report([EXIT_PEER_LOST, None], 0.0) is None, "wait for the cause"
    assert failure_to_report([EXIT_PEER_LOST, 1], 0.0) == (1, 1)
    assert failure_to_report([EXIT_PEER_LOST, -9], 0.0) == (1, -9)
    assert failure_to_report([EXIT_PEER_LOST, None], PEER_GRACE_S) == (0, EXIT_PEER_LOST)
    # A rank stuck inside torch exits 4 as soon as its stall report is out; the stalled one
    # (the cause) may end as late as its watchdog's bounds allow after it.
    stall_report_bound_s = 2 * STORE_TIMEOUT_S + 3.0 + OUTPUT_TURN_WAIT_S + ENDING_GRACE_S
    assert stall_report_bound_s < PEER_GRACE_S
    assert failure_to_report([EXIT_PEER_LOST, 0], 0.0) == (0, EXIT_PEER_LOST), "nobody left"
    stopped = failure_to_report([EXIT_PEER_LOST, None, None], 0.0, stopped=[1])
    assert stopped is None, "rank 2 may still end"
    assert failure_to_report([EXIT_PEER_LOST, None], 0.0, stopped=[1]) == (0, EXIT_PEER_LOST), (
        "a stopped rank cannot end: it is not waited for"
    )
    assert failure_line(0, EXIT_PEER_LOST, [EXIT_PEER_LOST, None], stopped=[1]) == (
        "rank 1's process is stopped (SIGSTOP: it does not run), and rank 0 lost "
        "contact with it (exit code 4)"
    )
    assert failure_to_report([EXIT_STOPPED, None], 60.0) is None
    assert failure_to_report([0, 0, None], 0.0) is None
    assert failure_to_report([2, 1], 0.0) == (0, 2)


def test_a_rank_ended_by_a_signal_is_told_by_the_signals_name() -> None:
    """gloo aborts a rank (SIGABRT) when the ranks call different collectives: the line says
    what an abort is and the likeliest cause; a kill is named as such."""
    aborted = failure_line(1, -6, [None, -6])
    assert aborted.startswith("rank 1 was ended by SIGABRT (exit code 134): an abort in native")
    assert "such as a wrapped model's forward on one rank only" in aborted
    assert failure_line(0, -9, [-9, None]) == "rank 0 was ended by SIGKILL (exit code 137)"
    assert failure_line(1, 1, [None, 1]) == "rank 1 exited with code 1"


def test_lost_peer_reads_gloo_and_nccl_messages_through_the_exception_chain() -> None:
    gloo = RuntimeError(
        "[pair.cc:553] Connection closed by peer [127.0.0.1]:24729. This is typically caused "
        "by a remote worker crashing."
    )
    assert lost_peer(gloo)
    try:
        try:
            raise gloo
        except RuntimeError as inner:
            raise ValueError("while reducing the interval sums") from inner
    except ValueError as outer:
        assert lost_peer(outer)
    assert lost_peer(RuntimeError("NCCL error: remote process exited or there was a network error"))
    assert not lost_peer(RuntimeError("Timed out waiting 5000ms for recv operation to complete"))
    assert not lost_peer(RuntimeError("injected failure on rank 1"))


@pytest.mark.e2e
def test_rendezvous_timeout_is_an_error_not_a_hang(tmp_path: Path) -> None:
    """Rank 0 of 2 is started alone: it must give up after dist.init_timeout_s."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    environment = clean_environ(
        HPC_DDP_LOCAL_RUN_ID="lonely",
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    result = run_train(
        [
            "--config",
            "configs/synthetic.yaml",
            "dist.init_timeout_s=3",
            f"run.output_dir={tmp_path}",
        ],
        environment,
    )
    assert result.returncode == 2
    assert "waited 3 s" in result.stderr and "not all 2 ranks arrived" in result.stderr
    assert "HINT:" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.e2e
def test_a_rank_without_rank_0_gives_up_in_one_line(tmp_path: Path) -> None:
    """Rank 1 of 2 alone, with a tiny dist.init_timeout_s: one line, none of torch's C++
    frames (which its own connect timeout logs)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    environment = clean_environ(
        HPC_DDP_LOCAL_RUN_ID="alone", RANK="1", LOCAL_RANK="1", WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    result = run_train(
        ["--config", "configs/synthetic.yaml", "dist.init_timeout_s=0.001",
         f"run.output_dir={tmp_path}"],
        environment,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"could not reach the rendezvous at 127.0.0.1:{port} within 0.001 s" in result.stderr
    assert "Connection refused" in result.stderr and "HINT:" in result.stderr
    assert "frame #" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.e2e
def test_rendezvous_port_in_use_is_reported(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run_local(
            2,
            tmp_path,
            [f"dist.master_port={port}", "dist.init_timeout_s=10", "tracking.enabled=false"],
        )
    assert result.returncode == 2
    assert f"rendezvous port 127.0.0.1:{port}: it is already in use" in result.stderr
    assert "HINT: another job on this node holds the port" in result.stderr


@pytest.mark.e2e
def test_user_errors_exit_2_with_a_hint_and_no_traceback(tmp_path: Path) -> None:
    result = run_train(["--config", "configs/digits.yaml", "train.epochz=3"], clean_environ())
    assert result.returncode == 2
    assert "unknown key 'train.epochz'" in result.stderr and "HINT: valid keys" in result.stderr
    assert "Traceback" not in result.stderr

    result = run_local(3, tmp_path, ["data.batch_size=64"], config="configs/digits.yaml")
    assert result.returncode == 2
    assert "world sizes that work with this batch: 1, 2, 4, 8, 16, 32, 64" in result.stderr


@pytest.mark.e2e
def test_python_without_srun_in_a_two_task_allocation_fails_in_seconds(tmp_path: Path) -> None:
    environment = clean_environ(
        SLURM_JOB_ID="99",
        SLURM_NTASKS="2",
        SLURM_TASKS_PER_NODE="2",
        SLURMD_NODENAME="node1",
        SLURM_JOB_NODELIST="node1",
    )
    result = run_train(["--config", "configs/digits.yaml"], environment)
    assert result.returncode == 2
    assert (
        "not started by srun" in result.stderr
        and "HINT: start training with `srun" in result.stderr
    )


@pytest.mark.e2e
def test_custom_dataset_and_model_by_import_path(tmp_path: Path) -> None:
    result = run_local(
        1,
        tmp_path,
        [
            "data.kind=custom",
            "data.factory=tests.factories:tiny_dataset",
            "model.kind=custom",
            "model.factory=tests.factories:linear_model",
            "data.batch_size=32",
            "train.epochs=2",
            "tracking.enabled=false",
        ],
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = read_summary(tmp_path)
    assert summary["val_samples"] == 44 and summary["global_step"] == 16


@pytest.mark.e2e
def test_replicas_that_drift_apart_are_named_at_the_next_check(tmp_path: Path) -> None:
    """Rank 1's model edits its own bias outside the optimizer (a user error DDP does not
    catch): the end-of-training check names the rank, the tensor and the step."""
    result = run_local(
        2,
        tmp_path,
        [
            "data.kind=custom",
            "data.factory=tests.factories:tiny_dataset",
            "model.kind=custom",
            "model.factory=tests.factories:drifting_model",
            "data.batch_size=32",
            "train.epochs=2",
            "checkpoint.enabled=false",
            "tracking.enabled=false",
        ],
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = read_summary(tmp_path)
    assert summary["global_step"] == 16
    assert summary["replicas_in_sync"] is False and summary["replicas_diverged_at"] == 16
    assert "model replicas differ from rank 0's at step 16: rank 1 (linear.bias)" in result.stderr
    assert "HINT:" in result.stderr


def test_replica_fingerprint_is_exact_per_tensor() -> None:
    first = torch.nn.Linear(4, 3)
    model = torch.nn.Sequential(first, torch.nn.Linear(3, 2).to(torch.bfloat16))
    before = replica_fingerprint(model)
    assert before.dtype == torch.int64 and before.shape == (4,)
    assert torch.equal(before, replica_fingerprint(model))
    with torch.no_grad():
        weight = first.weight
        weight[1, 2] = torch.nextafter(weight[1, 2], torch.tensor(2.0))  # one bit of one element
    after = replica_fingerprint(model)
    assert (after != before).tolist() == [True, False, False, False]


def test_the_weights_fingerprint_takes_a_batchnorm_model() -> None:
    """BatchNorm keeps its count of batches in a 0-dim integer tensor: the fingerprint a run's
    summary records must read it (it stopped every BatchNorm model's run at its end)."""
    from hpc_ddp.runtime.loop.replicas import weights_sha256

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    state = model.state_dict()
    before = weights_sha256(state)
    assert len(before) == 64 and before == weights_sha256(model.state_dict())
    state["1.num_batches_tracked"] += 1
    assert weights_sha256(state) != before, "the count is in it"


def test_running_statistics_are_no_replicas_and_every_other_entry_is() -> None:
    """Each rank's BatchNorm statistics follow its own batches between steps (DDP gives
    every rank rank 0's at the next forward): comparing them would be a false alarm."""
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Sequential(torch.nn.LayerNorm(3))
    )
    model.register_buffer("mask", torch.ones(3))
    assert list(replica_entries(model)) == [
        "mask",
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
        "2.0.weight",
        "2.0.bias",
    ]
    assert replica_fingerprint(model).shape == (7,)


@pytest.mark.e2e
def test_bad_model_factory_is_a_clear_error(tmp_path: Path) -> None:
    result = run_train(
        [
            "--config",
            "configs/synthetic.yaml",
            "model.kind=custom",
            "model.factory=tests.factories:not_a_module",
            f"run.output_dir={tmp_path}",
            "tracking.enabled=false",
        ],
        clean_environ(),
    )
    assert result.returncode == 2 and "returned str, not a torch.nn.Module" in result.stderr


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_eval_shards_cover_every_index_once(world_size: int) -> None:
    seen = [i for rank in range(world_size) for i in ShardedEvalSampler(1001, rank, world_size)]
    assert sorted(seen) == list(range(1001))
    assert sum(len(ShardedEvalSampler(1001, r, world_size)) for r in range(world_size)) == 1001


def test_lr_schedule_shapes() -> None:
    assert [lr_factor(s, 4, 100, "constant") for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_factor(100, 0, 100, "linear") == 0.0
    assert lr_factor(50, 0, 100, "cosine") == pytest.approx(0.5)


@pytest.mark.parametrize(("schedule", "warmup"), [("cosine", 3), ("linear", 0), ("constant", 2)])
def test_lr_schedule_follows_lambda_lr_and_resumes_in_place(schedule: str, warmup: int) -> None:
    """The same lr as torch's LambdaLR at every step, on every group; a state round trip
    (either way between the two) lands on the same step's lr."""

    def optimizer() -> torch.optim.Optimizer:
        groups = [{"params": [torch.zeros(1)], "lr": 0.1}, {"params": [torch.zeros(1)], "lr": 0.4}]
        return torch.optim.SGD(groups)

    ours_optimizer, reference_optimizer = optimizer(), optimizer()
    ours = LrSchedule(ours_optimizer, warmup, 10, schedule)
    reference = torch.optim.lr_scheduler.LambdaLR(
        reference_optimizer, lambda step: lr_factor(step, warmup, 10, schedule)
    )
    for _ in range(12):
        expected = [group["lr"] for group in reference_optimizer.param_groups]
        assert [group["lr"] for group in ours_optimizer.param_groups] == pytest.approx(expected)
        assert ours.lr == pytest.approx(expected[0])
        ours_optimizer.step()
        ours.step()
        reference_optimizer.step()
        reference.step()
    resumed_optimizer = optimizer()
    resumed = LrSchedule(resumed_optimizer, warmup, 10, schedule)
    resumed.load_state_dict(reference.state_dict())
    assert resumed.state_dict() == ours.state_dict() == {"last_epoch": 12}
    assert [g["lr"] for g in resumed_optimizer.param_groups] == pytest.approx(
        [g["lr"] for g in ours_optimizer.param_groups]
    )


def test_sums_are_exact_bounded_and_shaped() -> None:
    """Per-batch totals are kept and summed later; the sums must equal summing at once, in
    float64, for scalars and tensors, with tensor and number counts alike."""
    sums = Sums(torch.device("cpu"))
    sums.add("loss", torch.tensor(0.5) * 4, 4)
    sums.add("loss", 2.0 * 2, torch.tensor(2))
    sums.add("loss", torch.tensor(1.0, dtype=torch.bfloat16), 1)
    sums.add("confusion", torch.tensor([[1, 0], [2, 3]]), 6)
    sums.add("confusion", torch.tensor([[0, 1], [0, 0]]), 1)
    reduced = sums.reduce()
    assert reduced["loss"].count == 7 and reduced["loss"].mean == pytest.approx(7 / 7)
    assert reduced["loss"].total == pytest.approx(0.5 * 4 + 2.0 * 2 + 1.0)
    assert reduced["confusion"].total.tolist() == [[1.0, 1.0], [2.0, 3.0]]
    assert reduced["confusion"].count == 7
    with pytest.raises(HpcDdpError, match="with shape \\(2, 2\\) and now with \\(3,\\)"):
        sums.add("confusion", torch.zeros(3), 1)
    many = Sums(torch.device("cpu"))
    for _ in range(PENDING_MAX + 5):
        many.add("loss", torch.tensor(0.25), 1)
    assert len(many._entries["loss"].pending) == 6, "folded once, then five more kept"
    assert many.reduce()["loss"].mean == pytest.approx(0.25)


def test_folded_metric_totals_are_bitwise_each_converted_then_summed() -> None:
    """Totals of mixed dtypes in runs (a folded float64 sum first, float32 losses, a bf16
    one, int counts of correct answers) sum to exactly what converting each alone to float64
    and summing in their order gives."""
    generator = torch.Generator().manual_seed(0)
    totals = [torch.rand((), dtype=torch.float64, generator=generator) * 1e6]
    totals += [torch.rand((), generator=generator) * 3 for _ in range(500)]
    totals += [torch.tensor(1.7, dtype=torch.bfloat16), torch.tensor(2**40 + 1)]
    totals += [torch.rand((), generator=generator) for _ in range(300)]
    expected = torch.stack([total.to(torch.float64) for total in totals]).sum(dim=0)
    sums = Sums(torch.device("cpu"))
    for total in totals:
        sums.add("loss", total, 1)
    assert sums.local()[0].item() == expected.item()


@pytest.mark.e2e
def test_local_launcher_rejects_zero_ranks() -> None:
    result = subprocess.run(
        ["python", "-m", "hpc_ddp", "local", "--nproc", "0"],
        env=clean_environ(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "argument --nproc: 0 is too small: at least 1" in result.stderr


def train_with_factories(tmp_path: Path, data: str, model: str) -> subprocess.CompletedProcess[str]:
    return run_train(
        [
            "--config",
            "configs/synthetic.yaml",
            "data.kind=custom",
            f"data.factory=tests.factories:{data}",
            "model.kind=custom",
            f"model.factory=tests.factories:{model}",
            f"run.output_dir={tmp_path}",
            "tracking.enabled=false",
            "data.batch_size=32",
        ],
        clean_environ(),
    )


@pytest.mark.parametrize(
    ("data", "model", "message"),
    [
        ("dataset_without_seed", "linear_model",
         "dataset_without_seed' cannot be called the way the trainer calls it (too many"),
        ("strings_dataset", "linear_model", "returned str as train_dataset: not a map-style"),
        ("empty_val_dataset", "linear_model",
         "the validation set is empty (256 training, 0 validation samples)"),
        ("tiny_dataset", "model_without_classes",
         "HINT: define it as: def build(config, num_features, num_classes) -> torch.nn.Module"),
        ("tiny_dataset", "too_narrow_model",
         "the model cannot take one sample of the data (features of shape (5,)): RuntimeError"),
        ("tiny_dataset", "wrong_outputs_model",
         "returns (1, 5) for one sample; the trainer expects logits of shape (batch, num_classes)"),
    ],
)  # fmt: skip
@pytest.mark.e2e
def test_a_factory_that_breaks_the_contract_is_one_line(
    data: str, model: str, message: str, tmp_path: Path
) -> None:
    result = train_with_factories(tmp_path, data, model)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr, result.stderr[-2000:]
    assert "HINT:" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.e2e
def test_an_error_inside_a_factory_shows_the_users_frames_with_the_rank(tmp_path: Path) -> None:
    result = train_with_factories(tmp_path, "read_the_labels_file", "linear_model")
    assert result.returncode == 1, result.stderr[-2000:]
    failure = result.stderr[result.stderr.index("[rank 0] failed:") :]
    frames = re.findall(r'File "([^"]+)", line \d+, in (\w+)', failure)
    assert frames and frames[0] == (str(REPO / "tests" / "factories.py"), "read_the_labels_file")
    package = str(REPO / "hpc_ddp") + "/"  # the checkout itself may sit in a folder hpc_ddp/
    assert not [path for path, _name in frames if path.startswith(package)], frames
    assert "FileNotFoundError: [Errno 2] No such file or directory: '/nonexistent/" in failure


@pytest.mark.e2e
def test_a_model_split_in_two_stages_trains_to_the_unsplit_weights(tmp_path: Path) -> None:
    """model.stages=2 on 2 ranks, dist.gpus_per_rank=2: the built-in MLP in two stages, each
    on its own device of the rank. Here both devices are the CPU (a second GPU cannot exist
    on this machine), so DDP wraps one device; the weights must be those of the unsplit
    model, value for value, and the plan must name the rank's two devices."""
    common = ["train.epochs=2", "tracking.enabled=false", "data.num_samples=2048"]
    split = run_local(2, tmp_path / "split", [*common, "model.stages=2", "dist.gpus_per_rank=2"])
    assert split.returncode == 0, split.stderr[-2000:]
    assert "device cpu,cpu (" in split.stderr
    whole = run_local(2, tmp_path / "whole", common)
    assert whole.returncode == 0, whole.stderr[-2000:]
    split_weights, whole_weights = weights(tmp_path / "split"), weights(tmp_path / "whole")
    assert next(iter(split_weights)).startswith("stages.0.") and len(split_weights) == 6
    assert [tuple(t.shape) for t in split_weights.values()] == [
        tuple(t.shape) for t in whole_weights.values()
    ]
    pairs = zip(split_weights.values(), whole_weights.values(), strict=True)
    assert all(torch.equal(split_tensor, whole_tensor) for split_tensor, whole_tensor in pairs)


STORE_PROBE = """
import os, subprocess, sys
import hpc_ddp

run = hpc_ddp.start(tracking={"enabled": False}, checkpoint={"enabled": False})
if run.rank == 0:
    port = int(os.environ["MASTER_PORT"])
    probe = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 5)"
    for host in ("127.0.0.1", "127.0.0.2"):  # the announced address; another on this host
        reached = subprocess.run([sys.executable, "-c", probe, host, str(port)]).returncode == 0
        print(f"STORE {host} {'reached' if reached else 'refused'}", flush=True)
run.finish()
"""


@pytest.mark.e2e
def test_a_local_runs_store_listens_on_loopback_only(tmp_path: Path) -> None:
    """torch's rendezvous store takes any client without credentials: a local run's store
    listens on the announced 127.0.0.1 only. A second process on this host reaches it there
    and is refused at 127.0.0.2 (an address of this host that a store listening on every
    interface would answer; loopback, so the test stays off the network)."""
    (tmp_path / "probe.py").write_text(STORE_PROBE)
    result = run_local_program(
        2, ["--set", f"run.output_dir={tmp_path}", str(tmp_path / "probe.py")]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "STORE 127.0.0.1 reached" in result.stdout, result.stdout
    assert "STORE 127.0.0.2 refused" in result.stdout, result.stdout


@pytest.mark.parametrize("how", ["0", "3", "none", "os"])
@pytest.mark.e2e
def test_a_rank_that_leaves_the_loop_early_is_named_as_the_cause(how: str, tmp_path: Path) -> None:
    """The survivor exits 4 (lost contact); the launcher used to blame it and never named
    the rank that left."""
    result = run_local_program(
        2,
        ["--set", f"run.output_dir={tmp_path}", str(REPO / "tests/programs/leaves_early.py"), how],
    )
    assert result.returncode == EXIT_PEER_LOST, result.stderr[-3000:]
    code = "3" if how == "3" else "0"
    assert (
        f"hpc-ddp local: rank 1 left the run early (exit code {code}) while the others trained "
        "on, and rank 0 lost contact with it" in result.stderr
    ), result.stderr[-3000:]
