"""Checkpoints, exact mid-epoch resume, stop signals, one MLflow run across attempts, and
fast failure of a broken rank, on real local gloo ranks (the Slurm side is in
test_slurm_fault_tolerance.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from hpc_ddp.runtime.checkpoint.files import (
    FORMAT_VERSION,
    list_checkpoints,
    load_checkpoint,
    load_newest,
    remove_partial_writes,
    save_checkpoint,
)
from hpc_ddp.runtime.checkpoint.fingerprint import check_resumable, fingerprint_of
from hpc_ddp.runtime.errors import EXIT_STOPPED, HpcDdpError
from hpc_ddp.runtime.loop.data import ResumableDistributedSampler
from hpc_ddp.runtime.place.slurm import queue_job_id
from hpc_ddp.runtime.preempt.requeue import agent_signal_gap
from hpc_ddp.runtime.preempt.signals import StepAgreement, StopSignals
from hpc_ddp.runtime.tracking.base import default_tracking_uri
from hpc_ddp.runtime.tracking.record import read_metrics
from hpc_ddp.trainer.config import load_config, resume_fingerprint
from tests.helpers import (
    REPO,
    RESUMABLE,
    Lines,
    clean_environ,
    read_summary,
    run_local,
    run_local_program,
    signal_after,
    start_program,
)
from tests.records import final_weights


def state(step: int) -> dict[str, object]:
    return {"format": FORMAT_VERSION, "global_step": step, "weights": torch.full((4,), float(step))}


def test_save_is_atomic_keeps_last_k_and_loads_weights_only(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        save_checkpoint(state(step), tmp_path, step, keep_last=3)
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step-000000040.pt",
        "step-000000030.pt",
        "step-000000020.pt",
    ]
    assert not list(tmp_path.glob(".*tmp*"))
    path, loaded = load_newest(tmp_path)  # type: ignore[misc]
    assert path.name == "step-000000040.pt" and loaded["weights"].tolist() == [40.0] * 4
    torch.load(path, weights_only=True)


def test_corrupt_newest_checkpoint_falls_back_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_checkpoint(state(10), tmp_path, 10, keep_last=3)
    newest = save_checkpoint(state(20), tmp_path, 20, keep_last=3)
    newest.write_bytes(newest.read_bytes()[:100])  # truncated, as by a full disk
    (tmp_path / ".step-000000030.pt.tmp-999").write_bytes(b"half")  # a writer killed mid-save
    with caplog.at_level(logging.WARNING, logger="hpc_ddp"):
        path, loaded = load_newest(tmp_path)  # type: ignore[misc]
    assert loaded["global_step"] == 10 and path.name == "step-000000010.pt"
    assert str(newest) in caplog.text and "trying the previous one" in caplog.text
    remove_partial_writes(tmp_path)
    assert not list(tmp_path.glob(".*"))
    # Set aside, so the resumed run's own step 20 can never replace it.
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000000010.pt"]
    assert (tmp_path / "unreadable" / "step-000000020.pt").stat().st_size == 100


def test_a_folder_without_metadata_is_removed_only_when_this_run_was_writing_it(
    tmp_path: Path,
) -> None:
    """A writer killed mid-save leaves its folder marked (.writing-step-N beside it): that
    one is removed. A folder without .metadata and no mark (a copy that skipped dotfiles,
    a folder of another tool) is set aside in unreadable/, never deleted, and when no
    checkpoint loads the run is refused with nothing touched."""
    good = save_checkpoint(state(10), tmp_path, 10, keep_last=3)
    copied = tmp_path / "step-000000020"
    copied.mkdir()
    (copied / "__0_0.distcp").write_bytes(b"shard bytes")
    killed = tmp_path / "step-000000030"
    killed.mkdir()
    (killed / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / ".writing-step-000000030").touch()
    unfinished = remove_partial_writes(tmp_path)
    assert unfinished == [copied] and not killed.exists()
    assert not (tmp_path / ".writing-step-000000030").exists()
    path, loaded = load_newest(tmp_path, unfinished=unfinished)  # type: ignore[misc]
    assert path == good and loaded["global_step"] == 10
    assert (tmp_path / "unreadable" / copied.name / "__0_0.distcp").read_bytes() == b"shard bytes"

    alone = tmp_path / "alone"
    alone.mkdir()
    for step in (40, 50):
        (alone / f"step-0000000{step}").mkdir()
        (alone / f"step-0000000{step}" / "__0_0.distcp").write_bytes(b"shard")
    unfinished = remove_partial_writes(alone)
    assert len(unfinished) == 2
    with pytest.raises(HpcDdpError, match=r"no checkpoint in .* can be loaded .*no \.metadata"):
        load_newest(alone, unfinished=unfinished)
    assert sorted(path.name for path in alone.iterdir()) == ["step-000000040", "step-000000050"]


@pytest.mark.parametrize(
    "damage",
    [b"", b"garbage" * 10, "truncated", "newer format"],
    ids=["empty", "garbage", "truncated", "newer-format"],
)
def test_a_run_whose_only_checkpoint_cannot_be_read_is_refused_and_the_file_kept(
    tmp_path: Path, damage: bytes | str
) -> None:
    path = save_checkpoint(state(30), tmp_path, 30, keep_last=3)
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    elif damage == "newer format":
        torch.save({**state(30), "format": FORMAT_VERSION + 1}, path)
    else:
        path.write_bytes(damage)  # type: ignore[arg-type]
    before = path.read_bytes()
    with pytest.raises(HpcDdpError) as refused:
        load_newest(tmp_path)
    assert "no checkpoint in" in refused.value.message and "step-000000030.pt" in str(refused.value)
    assert "checkpoint.start_fresh_if_unreadable=true" in refused.value.hint
    if damage == "newer format":
        assert f"this hpc_ddp reads format {FORMAT_VERSION}" in refused.value.message
    assert path.read_bytes() == before, "nothing is touched"
    assert load_newest(tmp_path, start_fresh_if_unreadable=True) is None
    assert (tmp_path / "unreadable" / path.name).read_bytes() == before
    assert list_checkpoints(tmp_path) == []


def test_pruning_never_removes_the_checkpoint_just_written(tmp_path: Path) -> None:
    """A damaged file numbered above the run's steps used to count as the newest: with
    keep_last=1 every new checkpoint was deleted right after it was written."""
    stray = tmp_path / "step-999999999.pt"
    stray.write_bytes(b"damaged")
    for step in (10, 20):
        save_checkpoint(state(step), tmp_path, step, keep_last=1)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step-999999999.pt", "step-000000020.pt"]
    assert load_checkpoint(tmp_path / "step-000000020.pt")["global_step"] == 20


@pytest.mark.e2e
def test_a_checkpoints_path_that_cannot_hold_them_is_refused_at_the_start(
    tmp_path: Path,
) -> None:
    """`<run dir>/checkpoints` as a regular file, then as a link to itself: `hpc-ddp local`
    refuses in one line before training, instead of at the first save."""
    run_dir = tmp_path / "synthetic-mlp" / "blocked"
    run_dir.mkdir(parents=True)
    blocked = run_dir / "checkpoints"
    for make, says in (
        (lambda: blocked.write_text("x"), "not a directory"),
        (lambda: blocked.symlink_to(blocked), "a link that leads nowhere"),
    ):
        blocked.unlink(missing_ok=True)
        make()
        result = run_local(2, tmp_path, ["run.id=blocked", "tracking.enabled=false"])
        assert result.returncode == 2, result.stderr[-2000:]
        assert f"{blocked} cannot hold checkpoints: {says}" in result.stderr, result.stderr
        assert "HINT: remove" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.e2e
def test_an_unreadable_checkpoint_stops_every_rank_and_a_fresh_start_keeps_it(
    tmp_path: Path,
) -> None:
    """Real ranks: the run's only checkpoint is garbage. The run is refused on every rank in
    one line with the file as it was; told to start fresh, it trains from step 0 with the
    file moved aside, never overwritten."""
    checkpoints = tmp_path / "synthetic-mlp" / "damaged" / "checkpoints"
    checkpoints.mkdir(parents=True)
    garbage = checkpoints / "step-000000004.pt"
    garbage.write_bytes(b"not a checkpoint")
    common = ["run.id=damaged", "tracking.enabled=false", "train.epochs=1", "train.max_steps=8"]
    refused = run_local(2, tmp_path, common)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.count("no checkpoint in") >= 1 and "Traceback" not in refused.stderr
    assert garbage.read_bytes() == b"not a checkpoint"
    fresh = run_local(2, tmp_path, [*common, "checkpoint.start_fresh_if_unreadable=true"])
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert (checkpoints / "unreadable" / garbage.name).read_bytes() == b"not a checkpoint"
    assert load_checkpoint(list_checkpoints(checkpoints)[0])["global_step"] == 8


def test_resume_refuses_changes_that_matter_and_allows_harmless_ones() -> None:
    saved = fingerprint_of(resume_fingerprint(load_config(None)))
    harmless = load_config(
        None,
        ["train.epochs=50", "train.log_interval=3", "tracking.enabled=false", "dist.timeout_s=5"],
    )
    check_resumable(saved, fingerprint_of(resume_fingerprint(harmless)), Path("ckpt.pt"))
    with pytest.raises(HpcDdpError) as caught:
        check_resumable(
            saved,
            fingerprint_of(
                resume_fingerprint(load_config(None, ["model.hidden_sizes=[64]", "optim.lr=0.5"]))
            ),
            Path("ckpt.pt"),
        )
    message = str(caught.value)
    assert "cannot resume from ckpt.pt" in message
    assert (
        "model.hidden_sizes: [128, 128] -> [64]" in message
        or "model.hidden_sizes: [256, 256] -> [64]" in message
    )
    assert "optim.lr: 0.1 -> 0.5" in message


def test_sampler_resumes_mid_epoch_without_touching_consumed_samples() -> None:
    dataset = list(range(103))
    full = ResumableDistributedSampler(
        dataset, num_replicas=2, rank=1, shuffle=True, seed=3, drop_last=True
    )
    full.set_epoch(4)
    resumed = ResumableDistributedSampler(
        dataset, num_replicas=2, rank=1, shuffle=True, seed=3, drop_last=True
    )
    resumed.set_epoch(4)
    resumed.set_start(20)
    assert list(resumed) == list(full)[20:] and len(resumed) == len(full) - 20


def test_stop_signals_only_record(tmp_path: Path) -> None:
    signals = StopSignals("USR1").install()
    try:
        signal.raise_signal(signal.SIGTERM)
        assert signals.requested and not signals.wants_requeue
        signal.raise_signal(signal.SIGUSR1)
        assert signals.wants_requeue
    finally:
        signals.restore()
    assert StepAgreement(None).exchange(True, False) == (True, False)


def _default_dispositions() -> None:
    """The snippet's signals as a fresh shell has them: a test run under `nohup` (or
    `trap '' HUP`) would otherwise hand its ignored SIGHUP down."""
    for signum in (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)


def _run_snippet(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=clean_environ(),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_default_dispositions,
    )


HOLD_AND_SEND = """
import os, signal
from hpc_ddp.runtime.preempt.startup_signals import hold_stop_signals
hold_stop_signals()
for name in {names}:
    os.kill(os.getpid(), getattr(signal, name))
from hpc_ddp.runtime.preempt.signals import StopSignals
signals = StopSignals({warning!r}, stop_on_sigterm={on_term}).install()
print(sorted(signal.Signals(s).name for s in signals.received), signals.wants_requeue)
signals.restore()
after = signal.getsignal(signal.SIGUSR2), signal.getsignal(signal.SIGTERM)
print(getattr(after[0], "__name__", "") == "ignored_after_the_run", after[1] == signal.SIG_DFL)
"""


@pytest.mark.e2e
def test_signals_held_during_startup_meet_the_configured_handling() -> None:
    """Each signal held during start-up is handled once the handlers are installed: a
    stop signal is recorded (or ignored, SIGTERM under submitit), any other dies as it would
    have; afterwards the default handlers are back, but for the job's warning signal: Slurm
    may still send it after the run ended, and it is then ignored."""
    submitit_like = _run_snippet(
        HOLD_AND_SEND.format(names=["SIGUSR2", "SIGTERM", "SIGUSR2"], warning="USR2", on_term=False)
    )
    assert submitit_like.returncode == 0, submitit_like.stderr
    assert submitit_like.stdout.split("\n")[:2] == ["['SIGUSR2'] True", "True True"]
    assert submitit_like.stderr.count("SIGUSR2 arrived while this rank was starting") == 1
    assert "SIGTERM arrived while this rank was starting" in submitit_like.stderr

    not_a_stop_signal = _run_snippet(
        HOLD_AND_SEND.format(names=["SIGHUP"], warning="USR1", on_term=True)
    )
    assert not_a_stop_signal.returncode == -signal.SIGHUP, not_a_stop_signal.stdout
    assert not_a_stop_signal.stdout == ""


#: Registered before hpc_ddp is imported, the atexit function runs last: it reads what the
#: kernel does with the warning signal once the interpreter starts to finalize, which resets
#: every signal with a Python handler to its default action (CPython's _PySignal_Fini).
IGNORED_THROUGH_THE_EXIT = """
import atexit, re, signal
def kernel_disposition():
    status = open("/proc/self/status").read()
    ignored = int(re.search(r"SigIgn:\\s*([0-9a-f]+)", status).group(1), 16)
    print("ignored by the kernel at exit:", [
        name for name in ("SIGUSR1", "SIGUSR2", "SIGTERM")
        if ignored >> (getattr(signal, name) - 1) & 1
    ])
atexit.register(kernel_disposition)
from hpc_ddp.runtime.preempt.signals import StopSignals
{calls}
handlers = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)
print([getattr(handler, "__name__", "") for handler in handlers])
"""


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("calls", "handlers", "ignored"),
    [
        ('StopSignals("USR2").install().restore()', ["", "ignored_after_the_run"], ["SIGUSR2"]),
        (
            'StopSignals("USR1").install().ignore_from_now_on()',
            ["ignored_after_the_run", ""],
            ["SIGUSR1", "SIGTERM"],
        ),
        (
            "signal.signal(signal.SIGUSR2, lambda *_: None)\n"
            'StopSignals("USR2").install().restore()',
            ["", "<lambda>"],
            [],
        ),
        (
            "import hpc_ddp, tempfile\n"
            'run = hpc_ddp.start(tracking={"enabled": False}, '
            'run={"output_dir": tempfile.mkdtemp()})',
            ["_record", ""],
            ["SIGUSR1"],
        ),
        (
            "from hpc_ddp.launch.local import launch_local\n"
            "from hpc_ddp.launch.program import Program\n"
            'assert launch_local(1, Program("module", "this")) == 0',
            ["ignored_after_the_run", ""],
            ["SIGUSR1"],
        ),
    ],
    ids=["run-ended", "stopped", "a-handler-of-yours", "no-finish", "hpc-ddp-local"],
)
def test_the_warning_signal_stays_ignored_while_the_interpreter_exits(
    calls: str, handlers: list[str], ignored: list[str]
) -> None:
    """A warning signal in the last moment of a finished rank's exit does not end it with
    128+N: at exit the signals ignored after the run are SIG_IGN for the kernel, which the
    interpreter's finalization leaves as they are; a handler of the user's is left alone. The
    same holds for a run that ends at exit (no run.finish()) and for ``hpc-ddp local`` once
    its ranks ended."""
    process = _run_snippet(IGNORED_THROUGH_THE_EXIT.format(calls=calls))
    assert process.returncode == 0, process.stderr
    lines = process.stdout.splitlines()
    assert lines[-1] == f"ignored by the kernel at exit: {ignored}", process.stdout
    assert lines[-2] == str(handlers), process.stdout


def stopped_on_the_early_signal(process: subprocess.CompletedProcess[str], tmp_path: Path) -> str:
    """Assert that the trainer (run.id=early) stopped on a SIGUSR1 of its start-up, with one
    checkpoint at its stop; returns its stderr."""
    err = process.stderr
    assert process.returncode == EXIT_STOPPED, err[-3000:]
    assert "SIGUSR1 arrived while this rank was starting; handling it now" in err
    stop_step = int(re.search(r"checkpoint \(stop signal\) step (\d+)", err).group(1))  # type: ignore[union-attr]
    checkpoints = list_checkpoints(tmp_path / "synthetic-mlp" / "early" / "checkpoints")
    assert [path.name for path in checkpoints] == [f"step-{stop_step:09d}"]
    return err


#: hpc_ddp/train.py's own start, with Slurm's warning signal sent between holding the stop
#: signals and importing torch (where a busy node's seconds of import go).
SIGNAL_DURING_IMPORT = """
import os, signal, sys
from hpc_ddp.cli.entry import before_imports
before_imports(os.environ, sys.argv[1:], dry_run=False)
assert "torch" not in sys.modules
os.kill(os.getpid(), signal.SIGUSR1)
from hpc_ddp.cli.train import main
from hpc_ddp.runtime.exits import exit_process
exit_process(main(sys.argv[1:]))
"""


@pytest.mark.e2e
def test_warning_signal_while_importing_torch_still_checkpoints(tmp_path: Path) -> None:
    """Slurm's warning signal can come while a rank still imports torch (a short --time, a
    busy node). The rank must not die of it: it stops at its first check with a checkpoint.
    The signal is sent from inside the rank, at the one moment that matters, so the test
    does not race the import on a loaded machine."""
    process = subprocess.run(
        [
            sys.executable,
            "-c",
            SIGNAL_DURING_IMPORT,
            "--config",
            str(REPO / "configs/synthetic.yaml"),
            f"run.output_dir={tmp_path}",
            "run.id=early",
            "tracking.enabled=false",
            "train.epochs=100",
        ],
        cwd=REPO, env=clean_environ(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    err = stopped_on_the_early_signal(process, tmp_path)
    assert "to continue, run the same command with run.id=early" in err


#: A rank started as the srun template starts it (job-body.sh's program, python behind
#: ``blocked_until_held``), sent the job's warning signal before Python runs a line: the
#: shell in between signals itself, then execs python (a blocked signal stays pending).
SIGNAL_BEFORE_PYTHON = """
source "$("$PYTHON" -m hpc_ddp.launch.templates)"
exec "${blocked_until_held[@]}" bash -c 'kill -USR1 $$; exec "$@"' rank "$PYTHON" "${program[@]}"
"""


@pytest.mark.e2e
def test_a_warning_signal_sent_before_python_starts_waits_to_be_held(tmp_path: Path) -> None:
    """A requeued attempt may meet a stop signal at once (Slurm 22.05's scancel retries one
    sent while the job was requeued): before Python's first line it used to end the rank on
    the spot. The rank now starts with the signal blocked; its first line holds and unblocks
    it, and it stops at its first check with a checkpoint."""
    process = subprocess.run(
        ["bash", "-c", SIGNAL_BEFORE_PYTHON, "job", "configs/synthetic.yaml",
         f"run.output_dir={tmp_path}", "run.id=early", "tracking.enabled=false",
         "train.epochs=3"],
        cwd=REPO, env=clean_environ(PYTHON=sys.executable), capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    stopped_on_the_early_signal(process, tmp_path)


def test_torchrun_agent_that_would_die_of_the_warning_signal_is_named() -> None:
    slurm = {"SLURM_JOB_ID": "7"}
    handled = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    env_new = {**slurm, "TORCHELASTIC_SIGNALS_TO_HANDLE": handled}
    assert agent_signal_gap("torchelastic", env_new, "USR1") is None
    assert agent_signal_gap("slurm", slurm, "USR1") is None, "srun tasks are the ranks"
    assert agent_signal_gap("torchelastic", {}, "USR1") is None, "no Slurm, no warning signal"
    only_default = agent_signal_gap("torchelastic", env_new, "USR2")
    assert only_default is not None and f"it handles only {handled}" in only_default
    assert "HINT: with torch >= 2.9 export PET_SIGNALS_TO_HANDLE=" in only_default
    old_torch = agent_signal_gap("torchelastic", slurm, "USR1")
    assert old_torch is not None and "this torch's torchrun cannot" in old_torch


def test_the_job_requeued_is_the_array_task_where_there_is_one() -> None:
    assert queue_job_id({"SLURM_JOB_ID": "42"}) == "42"
    assert (
        queue_job_id({"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"})
        == "40_3"
    )
    assert queue_job_id({}) is None


@pytest.mark.e2e
def test_stopped_mid_epoch_and_resumed_equals_uninterrupted(
    tmp_path: Path, resumable_reference: Path
) -> None:
    # Stopped as on the warning signal at step 50, mid-epoch, whatever the machine's pace.
    stopping = run_local(2, tmp_path, [*RESUMABLE, "run.id=interrupted", "preempt.stop_at_step=50"])
    log = stopping.stderr
    assert stopping.returncode == EXIT_STOPPED, log[-3000:]
    stop_step = int(re.search(r"checkpoint \(stop signal\) step (\d+)", log).group(1))  # type: ignore[union-attr]
    assert stop_step == 50
    assert "to continue, run the same command with run.id=interrupted" in log
    # The stop's checkpoint holds the time trained so far though its epoch had not ended
    # (the resume's samples/s count it), at least the intervals logged before it.
    checkpoints = tmp_path / "synthetic-mlp" / "interrupted" / "checkpoints"
    saved = load_checkpoint(list_checkpoints(checkpoints)[0])
    logged = [row["metrics"] for row in read_metrics(checkpoints.parent)]
    rates = [m["interval/samples_per_s"] for m in logged if "interval/samples_per_s" in m]
    interval_s = sum(8 * 64 / rate for rate in rates)
    assert len(rates) == 6 and saved["global_step"] == 50, logged
    assert saved["train_time_s"] >= interval_s * (1 - 1e-9) > 0, (saved["train_time_s"], rates)

    resumed = run_local(2, tmp_path, [*RESUMABLE, "run.id=interrupted"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    position = f"(epoch {stop_step // 200}, step {stop_step % 200} of the epoch)"
    assert "resumed from" in resumed.stderr and f"at step {stop_step} {position}" in resumed.stderr
    expected, actual = (
        read_summary(resumable_reference, "synthetic-mlp", "reference"),
        read_summary(tmp_path, "synthetic-mlp", "interrupted"),
    )
    assert actual["weights_sha256"] == expected["weights_sha256"]
    assert actual["global_step"] == expected["global_step"] == 600
    assert (
        actual["train_loss"] == expected["train_loss"]
        and actual["val_loss"] == expected["val_loss"]
    )
    assert actual["resumed_from_step"] == stop_step

    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path))
    run = client.get_run(str(actual["mlflow_run_id"]))
    assert run.info.status == "FINISHED"
    assert run.data.tags["hpc_ddp.attempts"] == "2"
    assert run.data.tags["hpc_ddp.attempt.0.end"] == "killed"
    assert run.data.tags["hpc_ddp.attempt.1.start_step"] == str(stop_step)
    assert run.data.tags["hpc_ddp.attempt.1.end"] == "finished"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "interval/train_loss")]
    assert steps == list(range(8, 601, 8)), "global steps continue: none lost, none repeated"
    val_steps = [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")]
    assert val_steps == [200, 400, 600], "one step axis: each epoch's end"


@pytest.mark.e2e
def test_the_trainer_stopped_on_4_ranks_resumes_on_2_as_an_uninterrupted_2_rank_run(
    tmp_path: Path, resumable_reference: Path
) -> None:
    """The built-in trainer's side of a world-size change: the global batch (64) is split over
    2 ranks instead of 4, training goes on from the stop, and the weights agree with an
    uninterrupted 2-rank run to rounding (the all-reduce sums in another order)."""
    moved = [*RESUMABLE, "run.id=moved", "tracking.enabled=false"]
    stopping = run_local(4, tmp_path, [*moved, "preempt.stop_at_step=50"])
    assert stopping.returncode == EXIT_STOPPED, stopping.stderr[-3000:]
    stop_step = 50

    resumed = run_local(2, tmp_path, [*RESUMABLE, "run.id=moved", "tracking.enabled=false"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "checkpoint was written by 4 ranks, this run has 2" in resumed.stderr
    facts, expected = (
        read_summary(tmp_path, "synthetic-mlp", "moved"),
        read_summary(resumable_reference, "synthetic-mlp", "reference"),
    )
    assert (facts["world_size"], facts["resumed_from_world_size"]) == (2, 4)
    assert (facts["resumed_from_step"], facts["global_step"]) == (stop_step, 600)
    for name, tensor in final_weights(resumable_reference, "synthetic-mlp", "reference").items():
        torch.testing.assert_close(
            final_weights(tmp_path, "synthetic-mlp", "moved")[name], tensor, rtol=1e-4, atol=1e-5
        )
    assert abs(float(facts["val_loss"]) - float(expected["val_loss"])) < 1e-4


@pytest.mark.e2e
def test_the_trainer_refuses_a_new_world_size_when_dropout_draws_per_rank(tmp_path: Path) -> None:
    """Each rank's dropout stream cannot be split or merged into another number of ranks:
    the resume stops before training, names both world sizes and the fix."""
    dropout = [*RESUMABLE, "model.dropout=0.1", "run.id=dropout", "tracking.enabled=false"]
    stopping = run_local(4, tmp_path, [*dropout, "preempt.stop_at_step=10"])
    assert stopping.returncode == EXIT_STOPPED, stopping.stderr[-3000:]

    refused = run_local(2, tmp_path, dropout)
    assert refused.returncode != 0
    assert "the checkpoint was written by 4 ranks, this run has 2" in refused.stderr
    assert "HINT: resume with 4 ranks" in refused.stderr, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr


@pytest.mark.e2e
def test_resume_with_a_changed_model_is_refused(tmp_path: Path) -> None:
    first = run_local(
        1,
        tmp_path,
        ["train.max_steps=5", "data.num_samples=2048", "run.id=x", "tracking.enabled=false"],
    )
    assert first.returncode == 0, first.stderr[-2000:]
    second = run_local(
        1,
        tmp_path,
        [
            "train.max_steps=9",
            "data.num_samples=2048",
            "run.id=x",
            "tracking.enabled=false",
            "model.hidden_sizes=[32]",
        ],
    )
    assert second.returncode == 2
    assert (
        "the config changed in ways that break resuming: model.hidden_sizes: [256, 256] -> [32]"
        in second.stderr
    )


@pytest.mark.e2e
def test_sigterm_stops_cleanly_without_requeue_and_marks_the_run_killed(tmp_path: Path) -> None:
    """scancel's SIGTERM, passed on by the launcher: the ranks hold after step 30 until it
    reached them, then stop together at step 31."""
    program = [str(REPO / "tests" / "programs" / "regression.py"), "--epochs", "3",
               "--hold-at-step", "30", f"run.output_dir={tmp_path}", "run.id=term",
               "preempt.check_every_steps=1"]  # fmt: skip
    log = signal_after(start_program(2, program), r"HOLDING at step 30 \(rank 0\)", signal.SIGTERM)
    assert "checkpoint (stop signal) step 31:" in log, log[-3000:]
    assert "not requeueing" not in log, "SIGTERM asks for no requeue"
    runs = MlflowClient(tracking_uri=default_tracking_uri(tmp_path)).search_runs(["1"])
    assert [r.info.status for r in runs] == ["KILLED"]
    assert json.loads((tmp_path / "regression" / "term" / "status.json").read_text())["state"] == (
        "stopped"
    )


@pytest.mark.e2e
def test_hung_rank_is_caught_by_the_collective_timeout(tmp_path: Path) -> None:
    """Rank 1 hangs for an hour in its forward pass: rank 0's collective gives up after
    dist.timeout_s and the job ends (well inside run_local's 240 s). The 20 s are well past
    a busy machine's pauses, and no checks run (rank 0 alone writes the run directory's, for
    which the other rank's check all-reduce would wait)."""
    result = run_local(
        2,
        tmp_path,
        [
            "model.kind=custom",
            "model.factory=tests.factories:hanging_model",
            "dist.timeout_s=20",
            "checks.enabled=false",
            "tracking.enabled=false",
        ],
    )
    assert result.returncode != 0
    assert "rank 0 exited with code" in result.stderr
    assert "[rank 0] stopped: a collective waited 20 s (dist.timeout_s)" in result.stderr, (
        "gloo's own timeout ended it, said in one line"
    )
    assert "it is stuck or slower than that" in result.stderr


@pytest.mark.e2e
def test_ranks_end_when_their_local_launcher_is_killed(tmp_path: Path) -> None:
    """kill -9 of `hpc-ddp local` leaves no rank training unsupervised: each gets SIGTERM
    from the kernel (a stop it handles) and ends."""
    program = [str(REPO / "tests" / "programs" / "regression.py"), "--epochs", "50",
               "--log-interval", "5", f"run.output_dir={tmp_path}", "run.id=orphans",
               "tracking.enabled=false", "preempt.check_every_steps=1"]  # fmt: skip
    launcher = start_program(2, program)
    Lines(launcher).wait_for("INFO epoch 0 step")
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    assert len(children) == 2, children
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in children):
        time.sleep(0.2)
    alive = [pid for pid in children if Path(f"/proc/{pid}").exists()]
    assert not alive, f"ranks {alive} outlived their launcher"
    status = json.loads((tmp_path / "regression" / "orphans" / "status.json").read_text())
    assert status["state"] == "stopped", "rank 0 stopped as on a preemption, with a checkpoint"
    assert list_checkpoints(tmp_path / "regression" / "orphans" / "checkpoints")


@pytest.mark.e2e
def test_ranks_killed_outright_are_charged_by_the_next_attempt_with_their_redone_steps(
    tmp_path: Path,
) -> None:
    """SIGKILL to every rank (a lost node) leaves no account; the rerun charges the killed
    attempt to its last logged interval and counts the steps it takes again."""
    program = [str(REPO / "tests" / "programs" / "regression.py"), "--epochs", "50",
               "--log-interval", "5", f"run.output_dir={tmp_path}", "run.id=killed",
               "tracking.enabled=false"]  # fmt: skip
    launcher = start_program(2, [*program, "--hold-at-step", "40", "--hold-until",
                                 str(tmp_path / "never")])  # fmt: skip
    lines = Lines(launcher)
    lines.wait_for(r"HOLDING at step 40 \(rank 0\)")
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    for pid in children:
        os.kill(int(pid), signal.SIGKILL)
    assert launcher.wait(timeout=120) != 0
    run_dir = tmp_path / "regression" / "killed"
    logged = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line the kill cut short
            logged.append(json.loads(line))
    last_logged = max(entry["global_step"] for entry in logged if "global_step" in entry)
    assert 0 < last_logged <= 40
    rerun = run_local_program(2, [*program, f"preempt.stop_at_step={last_logged + 5}"])
    assert rerun.returncode == EXIT_STOPPED, rerun.stderr[-3000:]
    killed, again = json.loads((run_dir / "attempts.json").read_text())
    assert (killed["status"], killed["last_step"]) == ("killed", last_logged)
    assert killed["end_unix"] == max(e["time"] for e in logged if "global_step" in e)
    assert killed["account"]["allocation_s"] == killed["account"]["other_s"] > 0
    assert killed["ranks"] == 2
    assert (again["status"], again["last_step"]) == ("stopped", last_logged + 5)
    assert again["redone_steps"] == last_logged - again["from_step"]
    assert again["account"]["redone_s"] > 0


@pytest.mark.parametrize("save_mode", ["async", "single_file"])
@pytest.mark.e2e
def test_a_full_disk_keeps_the_previous_checkpoint_and_names_the_path(
    tmp_path: Path, save_mode: str
) -> None:
    """The full disk is real: a tmpfs (mounting one needs root, which CI has) as the run's
    checkpoint directory, with room for one checkpoint and a half. A folder written in the
    background fails on its writer's thread: the run learns it at its next save."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    common = [
        "run.id=x", "tracking.enabled=false", "train.epochs=1", "checkpoint.every_steps=20",
        f"checkpoint.save_mode={save_mode}",
    ]  # fmt: skip
    measured = run_local(1, tmp_path / "measure", [*common, "checkpoint.keep_last=1"])
    assert measured.returncode == 0, measured.stderr[-2000:]
    (written,) = list_checkpoints(tmp_path / "measure" / "synthetic-mlp" / "x" / "checkpoints")
    files = [written] if written.is_file() else list(written.iterdir())
    size = sum(-(-path.stat().st_size // 4096) * 4096 for path in files)
    room = -(-int(size * 1.5) // 4096) * 4096
    checkpoints = tmp_path / "full" / "synthetic-mlp" / "x" / "checkpoints"
    checkpoints.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={room}", "tmpfs", str(checkpoints)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs as root: {mounted.stderr}")
    suffix = ".pt" if save_mode == "single_file" else ""
    try:
        result = run_local(2, tmp_path / "full", common)
        saved = sorted(path.name for path in checkpoints.iterdir())
        # Only the step: a checkpoint loads memory-mapped, and a mapping left open would keep
        # the tmpfs busy at umount.
        previous_step = load_checkpoint(checkpoints / f"step-000000020{suffix}")["global_step"]
    finally:
        unmounted = subprocess.run(["umount", str(checkpoints)], check=False)
    assert unmounted.returncode == 0, "nothing holds the tmpfs once the run ended"
    assert result.returncode == 2, result.stderr[-3000:]
    assert saved == [f"step-000000020{suffix}"], "no partial write, the previous one kept"
    assert previous_step == 20
    line = next(line for line in result.stderr.splitlines() if "cannot write checkpoint" in line)
    assert f"{checkpoints}/step-000000040{suffix} (" in line, line
    assert re.search(r"; \d+(\.\d)? (B|KiB) free of \d+\.\d (KiB|MiB) on its file sys", line), line
    assert f"the previous checkpoint step-000000020{suffix} is kept" in line, line
    assert "HINT: free space" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.e2e
def test_a_summary_that_cannot_be_written_leaves_the_run_finished(tmp_path: Path) -> None:
    """The file system refuses summary.json at the very end (here a folder of that name
    stands where the file goes; a full disk refuses it the same way, with an OSError): one
    warning, exit 0, the run recorded as finished at its last step with its checkpoint."""
    run_dir = tmp_path / "synthetic-mlp" / "nosummary"
    (run_dir / "summary.json").mkdir(parents=True)
    common = ["run.id=nosummary", "tracking.enabled=false", "train.epochs=1", "train.max_steps=6"]
    result = run_local(2, tmp_path, common)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"cannot write {run_dir / 'summary.json'}" in result.stderr
    assert "Traceback" not in result.stderr
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "finished" and status["global_step"] == 6, status
    assert load_checkpoint(list_checkpoints(run_dir / "checkpoints")[0])["finished"]


LEAVES_A_CHILD = """
import os, pathlib, subprocess, sys, time
import hpc_ddp

run = hpc_ddp.start(tracking={"enabled": False}, checkpoint={"enabled": False})
started = pathlib.Path(sys.argv[1])
if run.rank == 0:
    # A helper of the user's own (as its own mp.spawn workers would be): it holds stdout.
    helper = subprocess.Popen(["sleep", "3600"])
    print("HELPER", helper.pid, flush=True)
    started.touch()
    time.sleep(3600)  # rank 1's failure ends this rank
else:
    deadline = time.monotonic() + 120
    while not started.exists():  # rank 0's helper runs
        if time.monotonic() > deadline:
            sys.exit("rank 0 started no helper within 120 s")
        time.sleep(0.01)
    raise RuntimeError("rank 1 fails")
"""


@pytest.mark.e2e
def test_processes_a_rank_started_end_with_the_ranks(tmp_path: Path) -> None:
    """`hpc-ddp local ... | tee log`: a process a rank started and left running kept the
    output pipe open, so the pipeline never returned; it ends with the ranks now. (The helper
    and rank 0 would hold the pipe for an hour: reading it to its end is the proof.)"""
    (tmp_path / "leaves.py").write_text(LEAVES_A_CHILD)
    program = [
        "--set",
        f"run.output_dir={tmp_path}",
        str(tmp_path / "leaves.py"),
        str(tmp_path / "started"),
    ]
    command = [sys.executable, "-m", "hpc_ddp", "local", "--nproc", "2", *program]
    result = subprocess.run(
        command, cwd=REPO, env=clean_environ(), capture_output=True, text=True, timeout=240,
        check=False,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    helper = int(result.stdout.split("HELPER ")[1].split()[0])
    assert (
        not Path(f"/proc/{helper}").exists()
        or "zombie" in Path(f"/proc/{helper}/status").read_text().lower()
    ), "the helper was ended"


LATE_SIGNALS = """
import os, signal, sys
import torch, hpc_ddp

stop = sys.argv[1] == "stop"
run = hpc_ddp.start(
    tracking={"enabled": False}, run={"output_dir": sys.argv[2], "id": "late"},
    preempt={"stop_at_step": 3} if stop else {},
)
model = run.wrap(torch.nn.Linear(2, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
run.register(model=model, optimizer=optimizer)
try:
    for batch in run.steps([torch.ones(4, 2)] * 6):
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    run.finish()
finally:  # the stop's exit, or after the final checkpoint: Slurm's warning, many times
    print(f"SIGNALLING from rank {run.rank}", flush=True)
    for _ in range(25):
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getppid(), signal.SIGUSR1)
"""


@pytest.mark.e2e
@pytest.mark.parametrize("ending", ["stop", "end"])
def test_a_burst_of_warning_signals_while_a_run_exits_changes_nothing(
    tmp_path: Path, ending: str
) -> None:
    """50 USR1 per rank (to the rank and to the launcher) during the exit of a stopped run,
    or after the final checkpoint of a finished one: the stop stays a stop (exit 3, its
    checkpoint) and the end an end (exit 0), no rank blamed for a signal."""
    script = tmp_path / "late_signals.py"
    script.write_text(LATE_SIGNALS)
    result = run_local_program(2, [str(script), ending, str(tmp_path)])
    output = result.stdout + result.stderr
    assert output.count("SIGNALLING from rank") == 2, output[-3000:]
    assert result.returncode == (EXIT_STOPPED if ending == "stop" else 0), output[-3000:]
    step = 3 if ending == "stop" else 6
    assert [
        path.name for path in list_checkpoints(tmp_path / "late_signals" / "late" / "checkpoints")
    ] == [f"step-{step:09d}"], output[-3000:]
    assert "exited with code" not in output and "killed by" not in output, output[-3000:]
