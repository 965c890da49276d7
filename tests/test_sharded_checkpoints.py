"""Folder checkpoints through torch.distributed.checkpoint, on real gloo ranks: each rank
writes its part, a background save survives nothing it should not (a kill -9 mid-write
leaves the previous one, a stop waits for it), older single-file checkpoints go on, and a
model's weights come out as one plain file."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hpc_ddp.runtime.checkpoint.files import list_checkpoints, load_checkpoint
from hpc_ddp.runtime.checkpoint.objects import object_kinds, restore_objects, tensor_states
from hpc_ddp.runtime.checkpoint.sharded.layout import METADATA, FolderObjects, folder_state
from hpc_ddp.runtime.checkpoint.sharded.metadata import check_files
from hpc_ddp.runtime.checkpoint.sharded.writing import stagers_are_reusable, write_folder
from hpc_ddp.runtime.checkpoint.writer import FolderSaves, Pending, needs_own_group
from hpc_ddp.runtime.errors import EXIT_STOPPED, HpcDdpError
from tests.helpers import (
    REPO,
    RESUMABLE,
    Lines,
    read_summary,
    run_local,
    run_local_program,
    run_python,
    start_program,
)

BALLAST = str(REPO / "tests" / "programs" / "ballast.py")


def checkpoints_of(output: Path) -> Path:
    (found,) = output.glob("*/*/checkpoints")
    return found


def ballast(output: Path, *extra: str) -> list[str]:
    return [BALLAST, f"run.output_dir={output}", "run.id=b", *extra]


def kill_after(process: subprocess.Popen[str], pattern: str) -> tuple[str, list[int]]:
    """Once a line of stdout matches ``pattern``: SIGKILL to every rank that printed its pid
    (a node lost mid-save: no handler runs). The output seen, and the pids."""
    lines = Lines(process, "stdout")
    lines.wait_for(pattern)
    pids = sorted({int(pid) for pid in re.findall(r"STEP \d+ (\d+)", "".join(lines.seen))})
    assert len(pids) == 2, lines.seen[-20:]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return lines.all(timeout=120), pids


@pytest.mark.e2e
def test_every_rank_writes_its_part_and_the_metadata_commits_it(tmp_path: Path) -> None:
    """Two ranks, one replicated state of 32 MiB: each writes about half of it, and the
    folder holds one .metadata; the model's weights come out as one plain file that loads
    into a fresh nn.Linear."""
    result = run_local_program(2, ballast(tmp_path, "checkpoint.save_mode=sync", "--steps=3",
                                          "--ballast-mb=32", "--save-every=100"))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    folder, first = list_checkpoints(checkpoints_of(tmp_path))  # run.every(100) at step 0
    assert (folder.name, first.name) == ("step-000000003", "step-000000001")
    assert (folder / METADATA).is_file()
    parts = sorted(path.stat().st_size for path in folder.glob("*.distcp"))
    assert len(parts) == 2, parts
    assert parts[0] > 0.4 * sum(parts), f"one rank wrote most of it: {parts}"
    assert 32 * 2**20 < sum(parts) < 34 * 2**20, "a replicated tensor is written once"

    exported = tmp_path / "model.pt"
    shown = run_python(["-m", "hpc_ddp", "export", str(folder.parent.parent), "--object",
                        "model", "-o", str(exported)])  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "'model' (2 tensors)" in shown.stdout
    fresh = nn.Linear(8, 1)
    fresh.load_state_dict(torch.load(exported, weights_only=True))
    assert read_summary(tmp_path)["weights_sha256"] is not None

    which = run_python(["-m", "hpc_ddp", "export", str(folder.parent.parent), "-o", "x.pt"])
    assert which.returncode == 2 and "2 registered models (model, ballast)" in which.stderr
    assert "HINT: name it with --object NAME" in which.stderr

    # Never onto a checkpoint, a directory or what is not a file; a failed write is a line.
    before = {path: path.read_bytes() for path in folder.iterdir()}
    for target, says in [
        (folder / METADATA, "inside a run's checkpoints"),
        (folder.parent / "step-000000009.pt", "inside a run's checkpoints"),
        (tmp_path, "is a directory"),
        (Path("/dev/null"), "not a regular file"),
        (exported / "model.pt", "cannot write"),
    ]:
        refused = run_python(["-m", "hpc_ddp", "export", str(folder.parent.parent), "--object",
                              "model", "-o", str(target)])  # fmt: skip
        assert refused.returncode == 2 and says in refused.stderr, (target, refused.stderr)
        assert "Traceback" not in refused.stderr
    assert {path: path.read_bytes() for path in folder.iterdir()} == before
    assert not (folder.parent / "step-000000009.pt").exists()


@pytest.mark.e2e
def test_the_ranks_share_the_checksum_reading_and_a_shard_only_rank_1_reads_is_caught(
    tmp_path: Path,
) -> None:
    """At a resume each rank reads and hashes about 1/W of the chosen folder, not rank 0
    all of it: a bit flipped in the file of rank 1's share is found by rank 1, the folder
    set aside on its word, and the run goes on from the one before."""
    first = run_local_program(2, ballast(tmp_path, "checkpoint.save_mode=sync", "--steps=4",
                                         "--ballast-mb=2", "--save-every=2"))  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    newest, previous = list_checkpoints(checkpoints_of(tmp_path))[:2]
    shards = sorted(path.name for path in newest.glob("*.distcp"))
    assert len(shards) == 2, shards
    damaged = newest / shards[1]  # every 2nd file from the 2nd: rank 1's share
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))

    again = run_local_program(2, ballast(tmp_path, "checkpoint.save_mode=sync", "--steps=6",
                                         "--ballast-mb=2", "--save-every=2"))  # fmt: skip
    err = again.stderr
    assert again.returncode == 0, err[-3000:]
    assert f"rank 1 on {socket.gethostname()}: {shards[1]} does not match its checksum" in err
    assert "rank 0 on" not in err, "rank 0 read only its own share"
    assert f"trying the previous one: {previous.name} loads" in err, err[-3000:]
    assert f"resumed from {previous}" in err, err[-3000:]
    assert (checkpoints_of(tmp_path) / "unreadable" / newest.name / shards[1]).is_file()


#: A folder written from an exit handler: by then the interpreter refuses new work to every
#: thread pool (concurrent.futures), as for a background save still writing at exit.
SAVE_AT_EXIT = """
import atexit, sys
from pathlib import Path
import torch
from hpc_ddp.runtime.checkpoint.sharded.writing import write_folder

def save() -> None:
    state = {"objects": {"model": {"w": torch.arange(2**20, dtype=torch.float32)}}}
    write_folder(state, Path(sys.argv[1]) / "step-000000001", None)
    print("SAVED")

atexit.register(save)
"""


@pytest.mark.e2e
def test_a_folder_written_while_the_interpreter_exits_is_whole_with_its_checksums(
    tmp_path: Path,
) -> None:
    """A background save can still be writing when the script's last line has run: its 4 MB
    tensor is hashed in line then, not refused by a thread pool that takes no more work."""
    script = tmp_path / "save_at_exit.py"
    script.write_text(SAVE_AT_EXIT)
    result = run_python([str(script), str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SAVED" in result.stdout, result.stderr[-3000:]
    folder = tmp_path / "step-000000001"
    check_files(folder)  # sizes, and every file's checksum
    assert len(list(folder.glob("*.distcp.sha256"))) == 1


@pytest.mark.e2e
def test_a_kill_during_a_background_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """SIGKILL to both ranks while the background save of step 21 has written its parts but
    not its .metadata (held there: --hold-commit-at): the unfinished folder is no
    checkpoint, the rerun resumes from step 11 and ends bitwise equal to an uninterrupted
    run."""
    common = ("--steps=30", "--ballast-mb=16")
    reference = run_local_program(2, [*ballast(tmp_path / "ref", *common)])
    assert reference.returncode == 0, reference.stderr[-3000:]

    output = tmp_path / "killed"
    process = start_program(2, ballast(output, *common, "--hold-commit-at=21"))
    log, _pids = kill_after(process, r"HOLDING the commit of step 21")
    checkpoints = checkpoints_of(output)
    unfinished = checkpoints / "step-000000021"
    assert unfinished.is_dir() and not (unfinished / METADATA).exists(), log[-2000:]
    assert len(list(unfinished.glob("*.distcp"))) == 2, "every rank's part was written"
    complete = [path.name for path in list_checkpoints(checkpoints)]
    assert complete == ["step-000000011", "step-000000001"]

    resumed = run_local_program(2, ballast(output, *common))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "at step 11 " in resumed.stderr
    assert (
        read_summary(output)["weights_sha256"] == read_summary(tmp_path / "ref")["weights_sha256"]
    )


@pytest.mark.e2e
def test_a_stop_during_a_background_save_waits_for_it_then_saves(tmp_path: Path) -> None:
    """The warning signal one step after the background save of step 11 began (rehearsed
    at step 12: preempt.stop_at_step): that save finishes, the stop's own save follows,
    and both are whole checkpoints; a save slower than the warning the job's signal gives
    is named at the first save."""
    settings = ("preempt.warning_s=0.001", "preempt.stop_at_step=12")
    result = run_local_program(2, ballast(tmp_path, "--steps=200", "--ballast-mb=128", *settings))
    err = result.stderr
    assert result.returncode == EXIT_STOPPED, err[-3000:]
    periodic = err.index("checkpoint (requested) step 11:")
    assert err.index("checkpoint (stop signal) step 12:") > periodic, err[-3000:]
    steps = [int(path.name[5:]) for path in list_checkpoints(checkpoints_of(tmp_path))]
    assert steps == [12, 11, 1]
    assert err.count("longer than the 0 s between the stop signal and the kill") == 1
    assert "HINT: warn earlier (#SBATCH --signal=USR1@300" in err


@pytest.mark.e2e
def test_a_single_file_checkpoint_goes_on_as_a_folder_run(
    tmp_path: Path, resumable_reference: Path
) -> None:
    """A run stopped mid-epoch with the single-file format of earlier versions resumes
    under folder checkpoints, and ends bitwise as the uninterrupted run does."""
    common = [*RESUMABLE, "tracking.enabled=false"]
    old = [*common, "run.id=old", "checkpoint.save_mode=single_file"]
    stopping = run_local(2, tmp_path, [*old, "preempt.stop_at_step=50"])
    assert stopping.returncode == EXIT_STOPPED, stopping.stderr[-3000:]
    checkpoints = tmp_path / "synthetic-mlp" / "old" / "checkpoints"
    stop_step = 50
    assert list_checkpoints(checkpoints)[0].name == f"step-{stop_step:09d}.pt"
    exported = tmp_path / "old.pt"
    shown = run_python(["-m", "hpc_ddp", "export", str(checkpoints.parent), "--step",
                        str(stop_step), "-o", str(exported)])  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    saved = torch.load(checkpoints / f"step-{stop_step:09d}.pt", weights_only=True)
    written = torch.load(exported, weights_only=True)
    assert written.keys() == saved["objects"]["model"].keys()
    assert all(torch.equal(written[key], saved["objects"]["model"][key]) for key in written)

    resumed = run_local(2, tmp_path, [*common, "run.id=old"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"at step {stop_step} " in resumed.stderr
    newest = list_checkpoints(checkpoints)[0]
    assert newest.is_dir() and load_checkpoint(newest)["global_step"] == 600
    expected, actual = (
        read_summary(resumable_reference, "synthetic-mlp", "reference"),
        read_summary(tmp_path, "synthetic-mlp", "old"),
    )
    assert actual["weights_sha256"] == expected["weights_sha256"]
    assert actual["val_loss"] == expected["val_loss"]


@pytest.mark.e2e
def test_a_background_save_is_timed_to_its_commit_not_to_the_next_save(tmp_path: Path) -> None:
    """Saves of 1 MB at least 12 s apart (a step paused 2 s), against a warning of 9 s: no
    warning (timed to the next save, each would read 12 s). The 9 s leave the commit of the
    run's first background save room on a busy machine."""
    result = run_local_program(2, ballast(tmp_path, "--steps=13", "--save-every=6",
                                          "--ballast-mb=1", "--step-pause=2",
                                          "preempt.warning_s=9"))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("checkpoint (requested) step") == 3
    assert "longer than the" not in result.stderr


@pytest.mark.e2e
def test_a_folder_left_at_a_step_by_an_earlier_run_is_replaced_whole(tmp_path: Path) -> None:
    """checkpoint.resume=false in a run directory that holds step-5/: the new save at step 5
    does not write into the old folder (whose .metadata would commit a mix of both)."""
    common = ["run.id=again", "tracking.enabled=false", "train.max_steps=5",
              "checkpoint.every_steps=5"]  # fmt: skip
    first = run_local(2, tmp_path, common)
    assert first.returncode == 0, first.stderr[-2000:]
    folder = checkpoints_of(tmp_path) / "step-000000005"
    (folder / "__7_0.distcp").write_bytes(b"left by the earlier run")
    again = run_local(2, tmp_path, [*common, "checkpoint.resume=false", "run.seed=3"])
    assert again.returncode == 0, again.stderr[-2000:]
    assert not (folder / "__7_0.distcp").exists()
    assert load_checkpoint(folder)["global_step"] == 5


@pytest.mark.e2e
def test_a_fresh_start_over_later_checkpoints_is_what_the_next_resume_continues(
    tmp_path: Path,
) -> None:
    """checkpoint.resume=false over a run that reached step 10: its checkpoints move to
    checkpoints/superseded/, and the next start resumes the new training (step 5), not the
    replaced one's step 10, which would drop the new training without a word."""
    common = ["run.id=again", "tracking.enabled=false", "checkpoint.every_steps=5"]
    first = run_local(2, tmp_path, [*common, "train.max_steps=10"])
    assert first.returncode == 0, first.stderr[-2000:]
    fresh = run_local(2, tmp_path, [*common, "train.max_steps=5", "checkpoint.resume=false"])
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    checkpoints = checkpoints_of(tmp_path)
    assert [path.name for path in list_checkpoints(checkpoints)] == ["step-000000005"]
    superseded = sorted(path.name for path in (checkpoints / "superseded").iterdir())
    assert superseded == ["step-000000005", "step-000000010"]
    assert "moved the superseded checkpoint step-000000010 to " in fresh.stderr
    resumed = run_local(2, tmp_path, [*common, "train.max_steps=8"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert read_summary(tmp_path, run_id="again")["resumed_from_step"] == 5


def test_an_optimizer_state_without_some_parameters_resumes_exactly(tmp_path: Path) -> None:
    """A parameter that never had a gradient (an unused branch) has no optimizer state in
    the checkpoint; the resume loads the rest and the next step is the uninterrupted one."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)  # type: ignore[no-any-return]

    torch.manual_seed(0)
    net = Net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    objects = {"model": net, "optimizer": optimizer}
    kinds = object_kinds(objects)
    assert kinds == {"model": "module", "optimizer": "optimizer"}
    folder = tmp_path / "step-000000001"
    write_folder(folder_state(tensor_states(objects, kinds, {}), {}, 0, {}), folder, None)
    again = Net()
    again_optimizer = torch.optim.AdamW(again.parameters(), lr=0.1)
    restored = {"model": again, "optimizer": again_optimizer}
    restore_objects(restored, FolderObjects(folder, kinds, {}), folder)
    assert len(again_optimizer.state) == len(optimizer.state) == 2
    batch = torch.randn(2, 3)
    for model, stepper in ((net, optimizer), (again, again_optimizer)):
        model(batch).sum().backward()
        stepper.step()
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), again.parameters(), strict=True))


def test_a_stop_after_a_failed_background_save_still_writes_its_own(tmp_path: Path) -> None:
    """The background save before a stop failed (here: its future holds the error): the
    stop's save logs that failure and is written, so the job can still requeue."""
    saves = FolderSaves(tmp_path, keep_last=3, group=None, is_main=True)
    failed: Future[Any] = Future()
    failed.set_exception(OSError(28, "No space left on device"))
    saves.pending = Pending(failed, tmp_path / "step-000000010", 10, "periodic", 0.0, [])
    state = folder_state({"model": {"w": torch.ones(2)}}, {"step": 12}, 0, {})
    saves.write(state, 12, "stop signal", background=False)
    assert [path.name for path in list_checkpoints(tmp_path)] == ["step-000000012"]
    saves.pending = Pending(failed, tmp_path / "step-000000014", 14, "periodic", 0.0, [])
    with pytest.raises(HpcDdpError, match=r"step-000000014 \(No space left on device\)"):
        saves.write(state, 16, "periodic", background=True)


def test_background_saves_go_on_where_torch_empties_the_stager_after_a_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.11's stager empties itself after each copy: a run's second background save
    failed with ``KeyError: <class 'type'>`` (seen on an H200). That torch cannot be
    installed beside this one, so its behaviour is put on this torch's stager; each save is
    read back."""
    from torch.distributed.checkpoint.staging import DefaultStager

    staging = DefaultStager.stage

    def stage_then_empty(self: Any, state_dict: Any, **kwargs: Any) -> Any:
        staged = staging(self, state_dict, **kwargs)
        self.close()  # what torch 2.11's stager does at the end of each copy
        return staged

    monkeypatch.setattr(DefaultStager, "stage", stage_then_empty)
    stagers_are_reusable.cache_clear()
    saves = FolderSaves(tmp_path, keep_last=3, group=None, is_main=True)
    kinds = {"model": "module"}
    try:
        for step in (10, 20):
            model = nn.Linear(3, 1, bias=False)
            nn.init.constant_(model.weight, float(step))
            state = folder_state(tensor_states({"model": model}, kinds, {}), {}, 0, {})
            saves.write(state, step, "periodic", background=True)
            saves.wait()
    finally:
        stagers_are_reusable.cache_clear()
    newest = list_checkpoints(tmp_path)[0]
    assert newest.name == "step-000000020"
    again = nn.Linear(3, 1, bias=False)
    restore_objects({"model": again}, FolderObjects(newest, kinds, {}), newest)
    assert torch.equal(again.weight, torch.full((1, 3), 20.0))
    assert saves.stager is None, "a stager that empties itself is not kept"


def test_background_saves_get_a_gloo_group_wherever_the_default_has_no_cpu_backend() -> None:
    """torch's async_save refuses a default group with no CPU backend (NCCL's), even at one
    rank: a GPU run at world size 1 failed its first background save (seen on an H200)."""
    assert needs_own_group(1, background_saves=True, backend="nccl")
    assert needs_own_group(4, background_saves=True, backend="gloo")
    assert not needs_own_group(1, background_saves=True, backend="gloo")
    assert not needs_own_group(4, background_saves=False, backend="nccl")


PER_RANK = str(REPO / "tests" / "programs" / "per_rank.py")


def tallies(output: str) -> dict[int, tuple[int, int, int]]:
    """Each rank's TALLY line: (the rank its tally belongs to, total, count)."""
    found = re.findall(r"TALLY (\d+) (\d+) (\d+) (\d+)", output)
    return {int(rank): (int(owner), int(total), int(count)) for rank, owner, total, count in found}


@pytest.mark.parametrize("save_mode", ["single_file", "sync"])
@pytest.mark.e2e
def test_state_registered_per_rank_comes_back_to_its_own_rank(
    tmp_path: Path, save_mode: str
) -> None:
    """Stopped at a step and run again, each rank's own tally goes on from its own value:
    saved from rank 0 alone, rank 1 would get rank 0's (owner 0, another total)."""
    program = [PER_RANK, "--steps", "40", "--pause", "0.05", f"run.output_dir={tmp_path}",
               "run.id=p", f"checkpoint.save_mode={save_mode}",
               "preempt.check_every_steps=1"]  # fmt: skip
    stopped = run_local_program(2, [*program, "preempt.stop_at_step=20"])
    assert stopped.returncode == EXIT_STOPPED, stopped.stderr[-3000:]
    again = run_local_program(2, program)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr
    whole = sum(range(40))
    assert tallies(again.stdout) == {0: (0, whole, 40), 1: (1, 2 * whole, 40)}

    # Each rank saved its own: another number of ranks cannot split or merge them.
    refused = run_local_program(3, program)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "cannot resume tally from" in refused.stderr
    assert "the checkpoint holds 2 ranks' states, this run has 3" in refused.stderr
    assert "HINT: resume on 2 ranks" in refused.stderr and "Traceback" not in refused.stderr


@pytest.mark.e2e
def test_per_rank_names_that_differ_between_ranks_are_refused_at_the_first_save(
    tmp_path: Path,
) -> None:
    """Each rank registered its tally under a name of its own: the first save says so on
    every rank, naming each rank's names, instead of a run that trains and then cannot
    resume."""
    program = [PER_RANK, "--steps", "10", "--rank-names", "checkpoint.every_steps=5",
               f"run.output_dir={tmp_path}"]  # fmt: skip
    refused = run_local_program(2, program)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert (
        "the ranks registered different objects per rank (rank 0: tally0; rank 1: tally1)"
    ) in refused.stderr
    assert "Traceback" not in refused.stderr
    assert list_checkpoints(checkpoints_of(tmp_path)) == []


@pytest.mark.e2e
def test_run_state_that_differs_between_ranks_is_named_once_at_a_save(tmp_path: Path) -> None:
    """A checkpoint keeps rank 0's run.state and a resume gives it to every rank: a value
    that differs by rank (a tensor here) is named at the first save that sees it, once,
    beside a value alike on every rank, which is not named."""
    program = [PER_RANK, "--steps", "15", "--state-by-rank", "checkpoint.every_steps=5",
               f"run.output_dir={tmp_path}"]  # fmt: skip
    result = run_local_program(2, program)
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if "run.state differs" in line]
    assert len(said) == 1, result.stderr[-3000:]
    assert said[0].endswith(
        "run.state differs between the ranks (total): a checkpoint keeps rank 0's values, and "
        "a resume gives them to every rank. HINT: keep state that differs from rank to rank "
        "in an object registered with run.register_per_rank(...)"
    ), said[0]
    assert "[rank 0/2] WARNING run.state differs" in said[0], "said by rank 0"
    assert len(list_checkpoints(checkpoints_of(tmp_path))) >= 1


def test_per_rank_names_that_differ_from_the_checkpoints_are_refused() -> None:
    from hpc_ddp.runtime.checkpoint.state import Registry

    registry = Registry()
    registry.add({"model": nn.Linear(1, 1)})
    registry.add({"buffer": nn.Linear(1, 1)}, per_rank=True)
    with pytest.raises(HpcDdpError, match=r"it holds no objects per rank, this run registered "
                       r"\['buffer'\] per rank") as refused:  # fmt: skip
        registry.restore_per_rank({"world_size": 2}, Path("step-5"), 2, 0, 2)
    assert "run.register_per_rank()" in str(refused.value)
    with pytest.raises(HpcDdpError, match=r"'model' is already registered with run\.register"):
        registry.add({"model": nn.Linear(1, 1)}, per_rank=True)
    with pytest.raises(HpcDdpError, match="'buffer' is already registered per rank"):
        registry.add({"buffer": registry.per_rank["buffer"]})
    with pytest.raises(HpcDdpError, match="'buffer' is already registered for another object"):
        registry.add({"buffer": nn.Linear(1, 1)}, per_rank=True)
    registry.add({"buffer": registry.per_rank["buffer"]}, per_rank=True)  # the same again
    registry.add({"model": registry.objects["model"]})


def test_a_folders_metadata_is_unpickled_once_however_often_a_resume_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume reads the run blob, its rank's blob, the optimizers' saved parameters and
    the tensors: each read would unpickle ``.metadata`` again (large for a model of many
    tensors). A folder written anew at the same path is read again."""
    from hpc_ddp.runtime.checkpoint.sharded.metadata import MetadataUnpickler, read_metadata
    from hpc_ddp.runtime.checkpoint.sharded.reading import load_objects, read_blobs

    unpickled = []
    original = MetadataUnpickler.load

    def counted(self: MetadataUnpickler) -> Any:
        unpickled.append(self)
        return original(self)

    monkeypatch.setattr(MetadataUnpickler, "load", counted)
    folder = tmp_path / "step-1"
    weights = {"w": torch.arange(4.0)}
    write_folder(folder_state({"model": weights}, {"step": 1}, 0, {"rng": 1}), folder, None)
    assert read_blobs(folder, ["run", "rank.0"]) == {"run": {"step": 1}, "rank.0": {"rng": 1}}
    assert "objects.model.w" in read_metadata(folder).state_dict_metadata
    template = {"model": {"w": torch.zeros(4)}}
    load_objects(folder, template)
    assert torch.equal(template["model"]["w"], weights["w"])
    assert len(unpickled) == 1, unpickled

    for part in folder.iterdir():
        part.unlink()
    write_folder(folder_state({"model": {"w": torch.ones(2)}}, {"step": 2}, 0, {}), folder, None)
    assert read_blobs(folder, ["run"]) == {"run": {"step": 2}}
    assert len(unpickled) == 2


class Planted:
    """What a planted pickle holds: unpickling it runs ``touch``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_a_planted_pickle_in_a_folder_runs_no_code(tmp_path: Path) -> None:
    """torch reads a folder's .metadata and each non-tensor item with plain pickle: hpc_ddp
    reads them admitting only what DCP and torch's safe loading write, so a planted one is
    refused (the folder is unreadable) and its code never runs."""
    import pickle

    from hpc_ddp.runtime.checkpoint.files import load_newest
    from hpc_ddp.runtime.checkpoint.sharded.layout import METADATA
    from hpc_ddp.runtime.checkpoint.sharded.reading import read_blobs

    ran = tmp_path / "code-ran"
    folder = tmp_path / "checkpoints" / "step-000000001"
    write_folder(
        folder_state({"model": {"w": torch.arange(4.0)}}, {"step": 1}, 0, {}), folder, None
    )
    original = (folder / METADATA).read_bytes()
    (folder / METADATA).write_bytes(pickle.dumps(Planted(ran)))
    with pytest.raises(HpcDdpError, match=r"no checkpoint in .* can be loaded .*never writes"):
        load_newest(folder.parent)
    assert not ran.exists()

    (folder / METADATA).write_bytes(original)
    item = tmp_path / "item"
    write_folder({"run": Planted(ran)}, item, None)  # DCP pickles a non-tensor item
    assert not ran.exists()
    with pytest.raises(BaseException, match=r"Unsupported global|weights_only"):
        read_blobs(item, ["run"])
    assert not ran.exists(), "the item's code did not run"


def test_a_checkpoint_that_vanishes_while_listed_is_not_taken_for_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 removes a failed save's folder while another rank lists the checkpoints to
    name the one kept: the folder, gone by the time it is looked at, is no checkpoint (it
    was once counted as a single file, and named as the one kept)."""
    from hpc_ddp.runtime.checkpoint import files

    (tmp_path / "step-000000020").mkdir()
    (tmp_path / "step-000000020" / METADATA).write_text("")
    (tmp_path / "step-000000040").mkdir()  # being written, then removed
    listed = Path.iterdir

    def removed_as_listed(self: Path) -> Any:
        entries = list(listed(self))
        if self == tmp_path and (tmp_path / "step-000000040").exists():
            (tmp_path / "step-000000040").rmdir()
        return iter(entries)

    monkeypatch.setattr(Path, "iterdir", removed_as_listed)
    assert [path.name for path in files.list_checkpoints(tmp_path)] == ["step-000000020"]
    (tmp_path / "step-000000050.pt").symlink_to(tmp_path / "nowhere")
    assert [path.name for path in files.list_checkpoints(tmp_path)] == ["step-000000020"]
