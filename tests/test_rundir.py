"""The run directory: a plain name under run.output_dir, writable, held by one live run at a
time. Real runs on local gloo ranks."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.runtime.errors import EXIT_STOPPED, HpcDdpError
from hpc_ddp.runtime.place.rundir import check_plain_name
from hpc_ddp.runtime.safefiles import folder_made
from tests.helpers import REPO, Lines, clean_environ, run_local_program, start_program

PROGRAM = str(REPO / "tests" / "programs" / "regression.py")


def one_line_error(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    [line] = [line for line in stderr.splitlines() if "] error: " in line][:1]
    return line


@pytest.mark.parametrize("run_id", ["../../escaped", "a/b", "..", ".hidden", "x" * 201])
@pytest.mark.e2e
def test_a_run_id_that_is_not_a_plain_name_is_refused(tmp_path: Path, run_id: str) -> None:
    output = tmp_path / "deep" / "runs"
    result = subprocess.run(
        [sys.executable, PROGRAM, "--epochs", "1", f"run.output_dir={output}", f"run.id={run_id}"],
        cwd=REPO, env=clean_environ(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "cannot name a run folder" in one_line_error(result.stderr)
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "deep" / "escaped").exists()


def test_plain_names_pass_as_they_are() -> None:
    for name in ("4211", "4211_7", "local-20261122-221228-21282", "exp.3+b"):
        assert check_plain_name(name, "run.id") == name
    with pytest.raises(HpcDdpError, match="HINT: use letters, digits"):
        check_plain_name("a b", "run.name")


def test_a_folder_that_cannot_be_made_is_named_with_why_and_the_hint(tmp_path: Path) -> None:
    """The one way the commands make a folder a person named (--log-dir, --output-dir)."""
    assert folder_made(tmp_path / "a" / "b", "the log folder", "pass another") == tmp_path / "a/b"
    assert (tmp_path / "a" / "b").is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(HpcDdpError) as refused:
        folder_made(tmp_path / "file" / "logs", "the job's log folder", "pass --log-dir ...")
    assert str(refused.value) == (
        f"cannot create the job's log folder {tmp_path / 'file' / 'logs'}: Not a directory\n"
        "HINT: pass --log-dir ..."
    )


@pytest.mark.e2e
def test_an_output_dir_that_cannot_be_created_stops_before_the_process_group(
    tmp_path: Path,
) -> None:
    (tmp_path / "file").write_text("not a directory")
    result = run_local_program(
        2, [PROGRAM, "--epochs", "1", f"run.output_dir={tmp_path / 'file' / 'runs'}"]
    )
    assert result.returncode == 2, result.stderr[-3000:]
    line = one_line_error(result.stderr)
    assert "cannot create or write the run directory" in line and "Not a directory" in line
    assert "process group" not in result.stderr and "rendezvous" not in result.stderr


@pytest.mark.e2e
def test_a_second_live_run_with_the_same_id_is_refused_naming_the_first(tmp_path: Path) -> None:
    """The first run holds at step 5 (alive, whatever the machine's pace) while the second
    starts; then a stop signal lets it go on to a stop."""
    program = [PROGRAM, "--epochs", "3", "--samples", "19200", "--log-interval", "5",
               f"run.output_dir={tmp_path}", "run.id=same", "tracking.enabled=false",
               "preempt.check_every_steps=1"]  # fmt: skip
    first = start_program(2, [*program, "--hold-at-step", "5"])
    held = Lines(first)
    held.wait_for(r"HOLDING at step 5 \(rank 0\)")
    second = run_local_program(2, program)
    first.send_signal(signal.SIGUSR1)
    rest = held.all()
    assert first.returncode == EXIT_STOPPED, rest[-3000:]
    assert second.returncode == 2, second.stderr[-3000:]
    line = one_line_error(second.stderr)
    run_dir = tmp_path / "regression" / "same"
    assert (
        f"run directory {run_dir} is in use by a live run (host {socket.gethostname()} pid " in line
    )
    holder = int(re.search(r"pid (\d+)\)", line).group(1))  # type: ignore[union-attr]
    assert holder > 0
    assert "HINT: wait for it to end, or give this run another run.id" in second.stderr
    again = run_local_program(2, program)
    assert again.returncode == 0, again.stderr[-3000:]  # the lock went with the first run
    assert "at step 6 (epoch 0, step 6 of the epoch)" in again.stderr, again.stderr[-3000:]


def contents(run_dir: Path) -> dict[Path, bytes]:
    """Every file of a run but its lock (which names the process holding it)."""
    return {path: path.read_bytes() for path in run_dir.rglob("*")
            if path.is_file() and path.name != ".lock"}  # fmt: skip


@pytest.mark.e2e
def test_a_finished_run_started_again_is_left_as_it_was_and_more_epochs_continue_it(
    tmp_path: Path,
) -> None:
    """The built-in trainer (the same holds for any script using run.epochs)."""
    from mlflow import MlflowClient

    from hpc_ddp.runtime.tracking.base import default_tracking_uri
    from tests.helpers import run_local

    run_dir = tmp_path / "synthetic-mlp" / "f"
    first = run_local(2, tmp_path, ["run.id=f", "train.epochs=1"])
    assert first.returncode == 0, first.stderr[-3000:]
    # A tag set while it trained (the idle-GPU alarm's; no GPU here): still not sent by a
    # start that finds the run finished, which leaves its MLflow run as it ended.
    tracking = json.loads((run_dir / "tracking.json").read_text())
    tracking["tags_set"] = {"hpc_ddp.idle_gpus": "node1 GPU 1 (rank 1)"}
    (run_dir / "tracking.json").write_text(json.dumps(tracking))
    files = {
        path: path.read_bytes()
        for path in run_dir.rglob("*")
        if path.is_file() and path.name != ".lock"
    }

    again = run_local(2, tmp_path, ["run.id=f", "train.epochs=1"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"run {run_dir} already finished at step " in again.stderr
    assert "Traceback" not in again.stderr
    assert {
        path: path.read_bytes()
        for path in run_dir.rglob("*")
        if path.is_file() and path.name != ".lock"
    } == files
    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path))
    [mlflow_run] = client.search_runs(experiment_ids=["1"])
    assert mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.tags["hpc_ddp.attempts"] == "1"
    assert "hpc_ddp.idle_gpus" not in mlflow_run.data.tags

    more = run_local(2, tmp_path, ["run.id=f", "train.epochs=2"])
    assert more.returncode == 0, more.stderr[-3000:]
    before = json.loads(files[run_dir / "summary.json"])
    after = json.loads((run_dir / "summary.json").read_text())
    assert after["global_step"] == 2 * before["global_step"]
    assert after["resumed_from_step"] == before["global_step"]
    assert math.isfinite(after["val_loss"]) and after["val_loss"] != before["val_loss"]
    # The start that found the run finished trained nothing and is no attempt of its time.
    assert (after["time_account"]["attempts"], before["time_account"]["attempts"]) == (2, 1)


def test_a_file_system_without_locks_warns_and_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A file system mounted without locks (Lustre's noflock) cannot exist here: flock is
    made to fail as it does there (ENOSYS)."""
    import errno
    import fcntl
    import logging

    from hpc_ddp.runtime.place import rundir

    def no_locks(_handle: object, _operation: int) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    monkeypatch.setattr(logging.getLogger("hpc_ddp"), "propagate", True)  # to caplog
    with caplog.at_level(logging.WARNING, logger="hpc_ddp"):
        rundir.claim_run_dir(tmp_path / "run")
    assert (tmp_path / "run" / ".lock").exists()
    assert "cannot lock the run directory" in caplog.text and "HINT: mount" in caplog.text


def run_as_user_would(
    tmp_path: Path, run_id: str, umask: str = "022"
) -> subprocess.CompletedProcess[str]:
    """The regression program on 2 local ranks with tracking on (its own files too), from a
    shell with ``umask``."""
    command = [sys.executable, "-m", "hpc_ddp", "local", "--nproc", "2", PROGRAM,
               "--epochs", "1", f"run.output_dir={tmp_path}", f"run.id={run_id}"]  # fmt: skip
    return subprocess.run(
        ["bash", "-c", f'umask {umask} && exec "$@"', "bash", *command],
        cwd=REPO, env=clean_environ(), capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip


@pytest.mark.e2e
def test_links_planted_in_a_run_directory_are_never_written_through(tmp_path: Path) -> None:
    """Run ids are predictable and project folders shared: links planted at the names the
    run writes (the old fixed temporary names included) must not lead its writes to the
    files they point at; under umask 000 nothing it makes is group- or world-writable."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run_dir = tmp_path / "regression" / "planted"
    run_dir.mkdir(parents=True)
    for name in (".status.json.tmp", ".tracking.json.tmp", ".summary.json.tmp"):
        (run_dir / name).symlink_to(victim)
    result = run_as_user_would(tmp_path, "planted", umask="000")
    assert result.returncode == 0, result.stderr[-3000:]
    assert victim.read_text() == "precious\n"
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    made = [run_dir, *run_dir.rglob("*")]
    writable = [str(p) for p in made if not p.is_symlink() and p.stat().st_mode & 0o022]
    assert writable == [], writable
    # A link where the lock goes: refused in one line, the file it points at untouched.
    (tmp_path / "regression" / "locked").mkdir()
    (tmp_path / "regression" / "locked" / ".lock").symlink_to(victim)
    refused = run_as_user_would(tmp_path, "locked")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert ".lock is a link" in one_line_error(refused.stderr)
    assert victim.read_text() == "precious\n"


@pytest.mark.e2e
def test_a_run_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    """Changing a folder's owner needs root (CI runs as root)."""
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    run_dir = tmp_path / "regression" / "theirs"
    run_dir.mkdir(parents=True)
    os.chown(run_dir, 4242, 4242)
    result = run_as_user_would(tmp_path, "theirs")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "belongs to another user (uid 4242" in one_line_error(result.stderr)


SPLIT_DISKS = """
import os, sys
import torch
if os.environ["RANK"] == "1":
    os.chdir(sys.argv[1])  # as a host whose working directory is on another disk
import hpc_ddp

run = hpc_ddp.start(tracking={"enabled": False}, run={"output_dir": "out", "id": "split"})
model = run.wrap(torch.nn.Linear(2, 1))
run.register(model=model)
for batch in run.steps([torch.ones(4, 2)] * 3):
    model(batch).sum().backward()
run.finish()
"""


@pytest.mark.e2e
def test_a_run_directory_one_rank_does_not_see_is_refused_before_any_checkpoint(
    tmp_path: Path,
) -> None:
    """A relative run.output_dir that rank 1 resolves elsewhere stands for a run directory
    on each node's own disk (a second host cannot exist here): every rank ends with the
    same line before training, and no checkpoint is split between the two folders."""
    script, node_a, node_b = tmp_path / "split.py", tmp_path / "a", tmp_path / "b"
    script.write_text(SPLIT_DISKS)
    node_a.mkdir()
    node_b.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "hpc_ddp", "local", "--nproc", "2", str(script), str(node_b)],
        cwd=node_a, env=clean_environ(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    said = "the run directory out/split/split that rank 0 made is not seen by 1 of 2 ranks"
    lines = [line for line in result.stderr.splitlines() if "] error: " in line]
    assert len(lines) == 2 and all(said in line for line in lines), result.stderr[-3000:]
    assert f"rank 1 on {socket.gethostname()} ({node_b})" in lines[0]
    assert "Traceback" not in result.stderr
    assert not list(node_a.glob("out/split/split/checkpoints/*")), "nothing written"
    assert not list(node_b.rglob("*.distcp")) and not list(node_a.rglob(".seen-by-every-rank-*"))


def test_the_ranks_that_do_not_see_the_run_directory_are_named(tmp_path: Path) -> None:
    from hpc_ddp.runtime.place.sharedfs import leave_mark, mark_unseen, refuse_unless_seen

    name = leave_mark(tmp_path)
    assert mark_unseen(tmp_path, name) is None
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert "No such file or directory" in str(mark_unseen(elsewhere, name))
    (elsewhere / name).write_bytes(b"another run's")
    assert 'holds b"another run\'s"' in str(mark_unseen(elsewhere, name))
    refuse_unless_seen(tmp_path, [None, None])
    with pytest.raises(HpcDdpError, match=r"not seen by 2 of 4 ranks \(rank 1 on h1: x; rank 3"):
        refuse_unless_seen(tmp_path, [None, "h1: x", None, "h3: y"])


@pytest.mark.e2e
def test_a_launch_from_a_removed_working_directory_is_one_line(tmp_path: Path) -> None:
    """A shell left in a folder someone removed: every rank would start there (torch then
    fails to load its own library), so the launcher says it before starting any."""
    gone = tmp_path / "gone"
    result = subprocess.run(
        ["bash", "-c", f'mkdir "{gone}" && cd "{gone}" && rmdir "{gone}" && exec "$0" "$@"',
         sys.executable, "-m", "hpc_ddp", "local", "--nproc", "1", PROGRAM],
        env={**clean_environ(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith(
        "hpc-ddp local: error: the working directory no longer exists"
    ), result.stderr[-3000:]
    assert "HINT: cd to an existing directory" in result.stderr
    listed = subprocess.run(
        ["bash", "-c", f'mkdir "{gone}" && cd "{gone}" && rmdir "{gone}" && exec "$0" "$@"',
         sys.executable, "-m", "hpc_ddp", "runs", str(tmp_path)],
        env={**clean_environ(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert listed.returncode == 0 and "no longer exists" not in listed.stderr, listed.stderr


@pytest.mark.e2e
def test_a_full_disk_at_the_run_directory_lock_is_one_line(tmp_path: Path) -> None:
    """The full disk is real: a tmpfs (mounting one needs root, which CI has) filled to the
    last byte; the run directory and its lock file are made (they take no data), writing
    the holder into the lock fails. The lock is let go, so the tmpfs unmounts."""
    from hpc_ddp.runtime.place.rundir import claim_run_dir

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert mounted.returncode == 0, f"cannot mount a tmpfs as root: {mounted.stderr}"
    try:
        filler = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            with pytest.raises(OSError, match="No space left"):
                while True:
                    os.write(filler, b"x" * 4096)
        finally:
            os.close(filler)
        with pytest.raises(HpcDdpError) as refused:
            claim_run_dir(disk / "name" / "id")
    finally:
        unmounted = subprocess.run(["umount", str(disk)], check=False)
    assert unmounted.returncode == 0, "nothing holds the tmpfs: the lock was let go"
    assert str(refused.value).startswith(f"cannot write {disk}/name/id/.lock: No space left")
    assert "HINT: free space or quota" in str(refused.value)
