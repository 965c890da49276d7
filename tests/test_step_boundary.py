"""The step boundary on the user's terms: any iterable as the steps (BatchStream), run.every,
run.save, run.accumulate, run.state, and the refusals that keep a converted script from
going wrong silently. Small objects in-process; whole runs as one-process subprocesses."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hpc_ddp.runtime.checkpoint.state import describe_load_error
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.loop.data import TrainLoader, step_source
from hpc_ddp.runtime.loop.streams import BatchStream, batch_length
from hpc_ddp.runtime.session.evaluation import eval_loader
from hpc_ddp.runtime.session.joining import refuse_nested_start
from tests.helpers import run_python


def test_each_kind_of_iterable_is_counted_and_resumed_its_own_way() -> None:
    loader = DataLoader(TensorDataset(torch.arange(20.0)), batch_size=2)
    replayed = BatchStream(loader, grad_accum_steps=2)
    assert (replayed.steps_per_epoch, replayed.endless, replayed.stateful) == (5, False, False)
    assert "replayed" in replayed.kind

    endless = BatchStream((torch.ones(4) for _ in itertools.count()), grad_accum_steps=1)
    assert (endless.steps_per_epoch, endless.endless) == (None, True)
    assert "restored random streams" in endless.kind

    class Stateful:
        def __init__(self) -> None:
            self.position = 0

        def __iter__(self) -> Iterator[torch.Tensor]:
            while True:
                self.position += 1
                yield torch.tensor([self.position])

        def state_dict(self) -> dict[str, int]:
            return {"position": self.position}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.position = state["position"]

    stateful = BatchStream(Stateful(), grad_accum_steps=1)
    assert stateful.stateful and stateful.endless and "saved per rank" in stateful.kind
    stateful.load_state_dict({"position": 41})
    assert next(iter(stateful)).item() == 42


def test_an_iterable_with_a_set_position_of_its_own_is_any_other_iterable() -> None:
    """Only a loader with the sizes of hpc_ddp.StepLoader is positioned by step: a user's
    iterable whose set_position means something else is replayed as any other."""

    class Playlist(list[int]):
        def set_position(self, seconds: float) -> None:
            raise AssertionError("hpc_ddp must not call it")

    stream = step_source(Playlist([1, 2, 3]), grad_accum_steps=None)
    assert isinstance(stream, BatchStream) and stream.steps_per_epoch == 3
    stream.set_position(epoch=0, step=1)
    assert list(stream) == [2, 3]
    loader = TrainLoader(
        TensorDataset(torch.arange(8.0)), rank=0, world_size=1, global_batch_size=4,
        grad_accum_steps=1, seed=0, num_workers=0, device=None,
    )  # fmt: skip
    assert step_source(loader, grad_accum_steps=None) is loader

    class Seekable(list[int]):  # sizes computed with numpy
        steps_per_epoch = np.int64(2)
        grad_accum_steps = np.int64(1)
        global_batch_size = np.int64(4)

        def set_position(self, epoch: int, step: int) -> None:
            pass

    seekable = Seekable([1, 2])
    assert step_source(seekable, grad_accum_steps=None) is seekable


def test_a_replayed_loader_starts_mid_epoch_with_the_random_streams_as_they_were() -> None:
    loader = DataLoader(TensorDataset(torch.arange(20.0)), batch_size=2, shuffle=False)
    stream = BatchStream(loader, grad_accum_steps=2)
    stream.set_position(epoch=0, step=3)  # 3 steps of 2 micro-batches of 2 samples
    torch.manual_seed(5)
    random.seed(5)
    before = torch.get_rng_state(), random.getstate()
    first = next(iter(stream))
    assert first[0].tolist() == [12.0, 13.0], "the 13th sample: 12 were trained on"
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert next(iter(stream))[0].tolist() == [0.0, 1.0], "the next pass is whole"


def test_a_batchs_size_is_read_from_its_first_tensor() -> None:
    assert batch_length(torch.zeros(5, 3)) == 5
    assert batch_length({"ids": [1, 2], "x": torch.zeros(7, 2)}) == 7
    assert batch_length((torch.zeros(()), torch.zeros(4))) == 4
    assert batch_length(None) is None and batch_length("text") is None


@pytest.mark.parametrize("value", ["loader", 3, None])
def test_what_is_not_an_iterable_of_batches_is_refused(value: object) -> None:
    with pytest.raises(HpcDdpError, match="not an iterable of batches"):
        BatchStream(value, grad_accum_steps=1)  # type: ignore[arg-type]


def mark_worker(worker_id: int) -> None:
    torch.manual_seed(worker_id)


@pytest.mark.e2e
def test_dataloader_options_a_tutorial_passes_are_accepted() -> None:
    dataset = TensorDataset(torch.arange(64.0))
    generator = torch.Generator()
    loader = TrainLoader(
        dataset,
        rank=0,
        world_size=2,
        global_batch_size=8,
        grad_accum_steps=1,
        seed=0,
        num_workers=1,
        device=None,
        pin_memory=False,
        prefetch_factor=2,
        persistent_workers=False,
        timeout=30,
        worker_init_fn=mark_worker,
        generator=generator,
        multiprocessing_context="fork",
    )
    assert (loader.loader.prefetch_factor, loader.loader.timeout) == (2, 30)
    assert loader.loader.generator is generator
    loader.set_position(0, 0)
    assert len(next(iter(loader))[0]) == 4


@pytest.mark.parametrize("option", ["sampler", "batch_sampler", "drop_last", "batch_size"])
def test_options_that_would_undo_the_sharding_are_refused_with_what_to_do(option: str) -> None:
    dataset = TensorDataset(torch.arange(64.0))
    with pytest.raises(HpcDdpError, match=f"{option}=.*shards the data itself") as refused:
        TrainLoader(
            dataset,
            rank=0,
            world_size=1,
            global_batch_size=8,
            grad_accum_steps=1,
            seed=0,
            num_workers=0,
            device=None,
            **{option: None},  # type: ignore[arg-type]
        )
    assert refused.value.hint
    with pytest.raises(HpcDdpError, match="drop_last"):
        eval_loader(
            dataset, rank=0, world_size=2, batch_size=4, num_workers=0, device=None, drop_last=True
        )


def test_a_refused_state_keeps_torchs_reason_and_names_a_compiled_model() -> None:
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    compiled_keys = {f"_orig_mod.{key}": value for key, value in plain.state_dict().items()}
    with pytest.raises(RuntimeError) as error:
        plain.load_state_dict(compiled_keys)
    reason, hint = describe_load_error(error.value)
    assert "Missing key(s) in state_dict (2): 0.weight, 0.bias" in reason
    assert "Unexpected key(s) in state_dict (2): _orig_mod.0.weight" in reason
    assert "torch.compile" in hint


def test_start_refuses_a_second_process_group_and_a_bare_multiprocessing_child() -> None:
    with pytest.raises(HpcDdpError, match="already initialized"):
        refuse_nested_start({}, initialized=True, child=False)
    with pytest.raises(HpcDdpError, match="multiprocessing") as refused:
        refuse_nested_start({}, initialized=False, child=True)
    assert "hpc_ddp.spawn(main" in refused.value.hint
    refuse_nested_start({"RANK": "0", "HPC_DDP_LOCAL_RUN_ID": "x"}, False, child=True)


STEPS = """
import itertools, json, sys
import numpy as np
import torch
import hpc_ddp

output, max_steps = sys.argv[1], int(sys.argv[2])
run = hpc_ddp.start(tracking={"enabled": False}, run={"output_dir": output, "id": "x"},
                    log_interval=2, checkpoint={"keep_last": 10})
model = run.wrap(torch.nn.Linear(2, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
run.register(model=model, optimizer=optimizer)
run.state.setdefault("best", 99.0)
seen = []
batches = (torch.full((3, 2), float(i)) for i in itertools.count())
for batch in run.steps(batches, grad_accum_steps=3, max_steps=max_steps):
    if run.every(2):
        seen.append([run.global_step, batch[0, 0].item()])
        run.state["best"] = min(run.state["best"], float(run.global_step))
    with run.accumulate(model):
        model(batch).sum().backward()
    if not run.accumulating:
        optimizer.step()
        optimizer.zero_grad()
    if run.global_step == 4:
        run.save()
print("RESULT " + json.dumps({"seen": seen, "state": run.state, "step": run.global_step}))
run.finish()
"""


def run_script(source: str, *arguments: str) -> subprocess.CompletedProcess[str]:
    return run_python(["-c", source, *arguments])


@pytest.mark.e2e
def test_every_fires_once_per_step_and_save_and_state_resume(tmp_path: Path) -> None:
    first = run_script(STEPS, str(tmp_path), "7")
    assert first.returncode == 0, first.stderr[-3000:]
    result = json.loads(first.stdout.split("RESULT ")[1])
    # Steps 0, 2, 4, 6, each on its FIRST micro-batch (3 micro-batches a step).
    assert result["seen"] == [[0, 0.0], [2, 6.0], [4, 12.0], [6, 18.0]]
    assert result["step"] == 7 and result["state"] == {"best": 0.0}
    assert "checkpoint (requested) step 5" in first.stderr, "at the end of the step asked in"
    assert "global batch 9 = 1 rank(s) x 3 per micro-batch x 3 micro-batch(es)" in first.stderr
    saved = sorted(path.name for path in tmp_path.glob("*/x/checkpoints/step-*"))
    assert saved == ["step-000000005", "step-000000007"]

    resumed = run_script(STEPS, str(tmp_path), "9")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = json.loads(resumed.stdout.split("RESULT ")[1])
    assert again["state"] == {"best": 0.0}, "the plain value came back from the checkpoint"
    assert again["seen"] == [[8, 3.0]], "a fresh generator from step 7: its 4th micro-batch"
    assert "resuming the batches at step 7: generator is an iterator" in resumed.stderr


SEEKING = """
import json, sys, time
import torch
import hpc_ddp

class Seeking:
    \"\"\"A store positioned by step whose seek takes a second (a remote shard's, say).\"\"\"
    steps_per_epoch, grad_accum_steps, global_batch_size = 4, 1, 8

    def set_position(self, epoch, step):
        time.sleep(1.0)

    def __iter__(self):
        return iter([torch.ones(8, 2)] * 4)

run = hpc_ddp.start(tracking={"enabled": False}, checkpoint={"enabled": False},
                    run={"output_dir": sys.argv[1], "id": "x"})
model = run.wrap(torch.nn.Linear(2, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    for batch in run.steps(Seeking()):
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
run.finish()
"""


@pytest.mark.e2e
def test_an_epochs_start_inside_run_steps_is_steps_time_not_the_scripts_own(
    tmp_path: Path,
) -> None:
    """Each of the 3 epochs' loaders takes a second to seek, as run.steps positions it: the
    time account has those seconds in ``steps`` (not in ``other``, the script's own work),
    while the samples' rate counts the steps' loop only."""
    result = run_script(SEEKING, str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = tmp_path.glob("*/x")
    [attempt] = json.loads((run_dir / "attempts.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 12
    assert attempt["account"]["steps_s"] >= summary["train_time_s"] + 3.0 - 0.002, attempt


REFUSALS = {
    "reserved": ("run.log('lr', 1.0, 1)", "run logs interval/lr itself"),
    "unloadable": (
        "run.register(extra=Extra())\nrun.resume()",
        "the registered 'extra' (Extra) has a state that a resume could not load back",
    ),
    "twice": ("hpc_ddp.start(tracking={'enabled': False})", "already initialized"),
    "state": (
        "run.state['x'] = np.float64(1)\nrun.save()",
        "run.state has a state that a resume could not load back",
    ),
}
PREAMBLE = """
import numpy as np
import torch
import hpc_ddp

class Extra:
    def state_dict(self):
        return {"weights": np.ones(2)}
    def load_state_dict(self, state):
        pass

run = hpc_ddp.start(tracking={"enabled": False}, run={"output_dir": OUTPUT})
"""


@pytest.mark.parametrize("case", sorted(REFUSALS))
@pytest.mark.e2e
def test_a_mistake_in_a_converted_script_is_one_line_and_exit_2(case: str, tmp_path: Path) -> None:
    code, message = REFUSALS[case]
    script = tmp_path / "script.py"
    script.write_text(PREAMBLE.replace("OUTPUT", repr(str(tmp_path))) + code + "\n")
    result = run_python([str(script)], cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr and "HINT:" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.e2e
def test_start_inside_a_plain_mp_spawn_child_is_refused_with_the_drop_in(tmp_path: Path) -> None:
    script = tmp_path / "article.py"
    script.write_text(
        "import torch.multiprocessing as mp\nimport hpc_ddp\n\n"
        "def main(rank):\n    hpc_ddp.start(tracking={'enabled': False})\n\n"
        "if __name__ == '__main__':\n    mp.spawn(main, nprocs=2)\n"
    )
    result = run_python([str(script)], cwd=tmp_path)
    assert result.returncode != 0
    # Each child says it in one line and exits 2; torch's parent then reports that exit code
    # (its own frames, in the script's mp.spawn call): no frame of hpc_ddp's code is shown.
    assert "error: hpc_ddp.start() in a process started by multiprocessing" in result.stderr
    assert "HINT: replace mp.spawn(main, args=..., nprocs=N) with hpc_ddp" in result.stderr
    assert "terminated with exit code 2" in result.stderr, result.stderr[-2000:]
    assert "hpc_ddp/runtime" not in result.stderr, result.stderr[-2000:]
    assert not list(tmp_path.glob("runs/*/*/checkpoints")), "nothing trained at world size 1"


WATCHED = """
import sys, time
import torch
import hpc_ddp

where, output = sys.argv[1:3]
run = hpc_ddp.start(tracking={"enabled": False}, checkpoint={"enabled": False},
                    dist={"stall_timeout_s": 15, "timeout_s": 60}, run={"output_dir": output})
for iter_num in run.iterations(max_steps=6):
    if run.every(3):
        if where == "evaluation" and iter_num == 3:
            time.sleep(17)  # an evaluation longer than the stall timeout: no stall
    if where == "step" and iter_num == 4:
        time.sleep(600)  # a step that hangs: the watchdog ends the rank long before
print("RESULT", run.global_step)
run.finish()
"""


@pytest.mark.e2e
def test_the_stall_watchdog_rests_while_every_runs_and_watches_the_steps(tmp_path: Path) -> None:
    evaluated = run_script(WATCHED, "evaluation", str(tmp_path))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "RESULT 6" in evaluated.stdout and "stalled" not in evaluated.stderr
    stalled = run_script(WATCHED, "step", str(tmp_path))
    assert stalled.returncode == 5, stalled.stderr[-3000:]
    assert "rank 0 stalled: no training step finished" in stalled.stderr
