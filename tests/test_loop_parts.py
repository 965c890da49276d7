"""The step boundary's named parts, each on its own, in this process at world size 1 (no
process group: the collectives they make are then no-ops): the position, the cadence, the
checkpointer (what a checkpoint holds, written and restored), the stopper (the agreed stop's
consequences) and the per-rank states of a user's iterable."""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Iterator, Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from hpc_ddp.runtime.checkpoint.files import checkpoint_dir, list_checkpoints, load_newest
from hpc_ddp.runtime.checkpoint.loading import Resumed, restore_registered
from hpc_ddp.runtime.config import CheckpointConfig, RunConfig, RuntimeConfig
from hpc_ddp.runtime.errors import EXIT_STOPPED, HpcDdpError, Stopped
from hpc_ddp.runtime.loop.cadence import CHECK_EVERY_MAX, Cadence, steps_for
from hpc_ddp.runtime.loop.checkpointer import Checkpointer
from hpc_ddp.runtime.loop.context import RunContext
from hpc_ddp.runtime.loop.intervals import MetricLog
from hpc_ddp.runtime.loop.position import Position
from hpc_ddp.runtime.loop.stopper import Stopper, continue_hint
from hpc_ddp.runtime.loop.streams import (
    BatchStream,
    StreamStates,
    Ticks,
    batch_length,
    no_samples,
)
from hpc_ddp.runtime.monitor.attempt_times import AttemptTimes
from hpc_ddp.runtime.preempt.progress import read_failures
from hpc_ddp.runtime.preempt.signals import StopSignals
from hpc_ddp.runtime.session.evaluation import EvalBatches, eval_loader
from hpc_ddp.runtime.session.joining import resolve_launch
from hpc_ddp.runtime.tracking.base import NullTracker


class Counting:
    """A user's endless iterable that keeps its own position."""

    def __init__(self) -> None:
        self.position = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            self.position += 1
            yield torch.tensor([float(self.position)])

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


class Recorder(NullTracker):
    """A tracker that remembers how the run ended."""

    def __init__(self) -> None:
        self.ended: list[str] = []

    def finish(self, status: str) -> None:
        self.ended.append(status)


def context_in(
    tmp_path: Path, tracker: Any = None, save_mode: str = "async", checkpoints: bool = True
) -> RunContext:
    settings = RuntimeConfig(
        run=RunConfig(output_dir=str(tmp_path), id="unit"),
        checkpoint=CheckpointConfig(save_mode=save_mode, enabled=checkpoints),  # type: ignore[arg-type]
    )
    plan = resolve_launch(settings, "unit", {})
    plan.run_dir.mkdir(parents=True)
    return RunContext(
        config=settings,
        plan=plan,
        control_group=None,
        signals=StopSignals("USR1"),
        tracker=tracker or NullTracker(),
        environ={},
        fingerprint={"lr": "0.1"},
        log_interval=None,
    )


def parts(context: RunContext) -> tuple[Position, StreamStates, Checkpointer]:
    position = Position()
    streams = StreamStates(rank=0, world_size=1)
    checkpointer = Checkpointer(context, position, MetricLog(context), streams, nullcontext)
    return position, streams, checkpointer


def test_the_position_saves_its_numbers_and_resumes_from_them() -> None:
    position = Position(epoch=2, step_in_epoch=7, global_step=47, train_time_s=3.5)
    saved = position.saved()
    assert saved == {"epoch": 2, "step_in_epoch": 7, "global_step": 47, "train_time_s": 3.5}
    resumed = Position()
    resumed.restore(saved, world_size=4)
    assert (resumed.epoch, resumed.step_in_epoch, resumed.global_step) == (2, 7, 47)
    assert (resumed.resumed_from_step, resumed.resumed_from_world_size) == (47, 4)
    assert resumed.last_checkpoint_step == 47, "no second checkpoint at the step resumed from"


def test_the_position_says_where_the_run_ended_for_its_summary() -> None:
    position = Position(epoch=3, global_step=40, train_time_s=2.0, replicas_diverged_at=None)
    position.restore({"epoch": 1, "step_in_epoch": 0, "global_step": 10, "train_time_s": 0.5}, 2)
    position.global_step, position.train_time_s, position.first_step_unix = 40, 2.0, 123.0
    facts = position.summary(global_batch_size=64)
    assert facts == {
        "resumed_from_step": 10,
        "resumed_from_world_size": 2,
        "epochs": 1,
        "global_step": 40,
        "samples_seen": 40 * 64,
        "train_time_s": 2.0,
        "samples_per_s": 1280.0,
        "replicas_in_sync": True,
        "replicas_diverged_at": None,
        "first_step_unix": 123.0,
    }
    unknown = position.summary(global_batch_size=0)  # batches holding no tensor: a range's
    assert (unknown["samples_seen"], unknown["samples_per_s"]) == (None, None)


def test_a_fresh_resume_seeds_each_ranks_own_streams_from_the_seed_rank_and_step(
    tmp_path: Path,
) -> None:
    from hpc_ddp.runtime.loop.data import mixed_seed

    context = context_in(tmp_path)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    context.registry.add({"model": model, "optimizer": optimizer})
    _position, _streams, checkpointer = parts(context)
    assert checkpointer.resume(None) is None, "nothing to resume from"
    drawn = torch.rand(2)
    torch.manual_seed(mixed_seed(context.config.run.seed, 0, 0))
    assert torch.equal(drawn, torch.rand(2))


def test_the_plan_report_checks_the_trainers_batch_against_the_ranks(tmp_path: Path) -> None:
    from hpc_ddp.launch.doctor import plan_report

    settings = RuntimeConfig(run=RunConfig(output_dir=str(tmp_path), id="plan"))
    plan = resolve_launch(settings, "plan", {})
    report = plan_report(plan, (64, 2))
    assert report["ok"] and report["per_rank_batch"] == 32 and report["world_size"] == 1
    assert ["ok", "global batch 64 = 1 ranks x 32 x 2 accumulation"] in report["checks"]
    assert plan_report(plan)["per_rank_batch"] is None, "a script divides its own batch"
    with pytest.raises(HpcDdpError, match=r"data\.batch_size"):
        plan_report(plan, (63, 2))


def test_the_cadence_keeps_what_is_set_and_measures_the_rest() -> None:
    fixed = Cadence(check_every=3, log_interval=7, group=None, is_main=False)
    assert fixed.calibrated and (fixed.check_every, fixed.log_interval) == (3, 7)
    measured = Cadence(check_every=None, log_interval=None, group=None, is_main=False)
    assert not measured.calibrated
    measured.calibrate(steps=200, elapsed_s=2.0)  # 100 steps/s
    assert (measured.check_every, measured.log_interval) == (100, 500)
    assert steps_for(1e9, 1.0, CHECK_EVERY_MAX) == CHECK_EVERY_MAX and steps_for(0.01, 1, 9) == 1


@pytest.mark.parametrize("save_mode", ["async", "sync", "single_file"])
def test_the_checkpointer_owns_what_a_checkpoint_holds_and_puts_it_back(
    tmp_path: Path, save_mode: str
) -> None:
    context = context_in(tmp_path, save_mode=save_mode)
    model = torch.nn.Linear(3, 2)
    context.registry.add({"model": model})
    context.values["best"] = 0.25
    position, streams, checkpointer = parts(context)
    counting = Counting()
    streams.take(BatchStream(counting, grad_accum_steps=1), resumed_from_step=None)
    counting.position = 11
    position.global_step, position.epoch, position.step_in_epoch = 30, 1, 5
    torch.manual_seed(3)
    checkpointer.save("periodic")
    expected_draw = torch.rand(3)
    checkpointer.wait()
    path, saved = load_newest(checkpoint_dir(context.run_dir))  # type: ignore[misc]
    assert path.name == "step-000000030" + (".pt" if save_mode == "single_file" else "")
    assert set(saved) >= {"objects", "values", "streams", "rng", "metrics", "fingerprint"}
    assert saved["values"] == {"best": 0.25}
    assert len(saved["streams"]) == 1 and saved["streams"][0] == {"position": 11}
    assert (saved["global_step"], saved["epoch"], saved["step_in_epoch"]) == (30, 1, 5)
    assert saved["fingerprint"] == {"lr": "0.1"} and saved["finished"] is False
    checkpointer.save("periodic")
    checkpointer.wait()
    assert len(list_checkpoints(checkpoint_dir(context.run_dir))) == 1, "once per step"
    saved_weight = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)  # after the save: the checkpoint must not see it

    again = context_in(tmp_path / "again")
    again.registry.add({"model": torch.nn.Linear(3, 2)})
    position2, streams2, checkpointer2 = parts(again)
    torch.manual_seed(99)
    resumed = checkpointer2.resume((path, saved))
    assert resumed == Resumed(path, step=30, world_size=1, finished=False)
    assert torch.equal(again.registry.objects["model"].weight, saved_weight)
    assert torch.equal(torch.rand(3), expected_draw), "the random stream goes on"
    assert (position2.global_step, position2.resumed_from_step) == (30, 30)
    assert again.values == {"best": 0.25}
    fresh = Counting()
    streams2.take(BatchStream(fresh, grad_accum_steps=1), resumed_from_step=30)
    assert fresh.position == 11, "the stream's own state came back"


def test_a_value_a_resume_could_not_load_is_refused_at_the_save(tmp_path: Path) -> None:
    context = context_in(tmp_path)
    context.values["when"] = object()
    _position, _streams, checkpointer = parts(context)
    with pytest.raises(HpcDdpError, match=r"run\.state has a state that a resume could not"):
        checkpointer.save("periodic")
    assert not list_checkpoints(checkpoint_dir(context.run_dir)), "nothing half-written"


def test_the_stopper_checkpoints_ends_the_tracking_and_raises_stopped(tmp_path: Path) -> None:
    tracker = Recorder()
    context = context_in(tmp_path, tracker)
    position, _streams, checkpointer = parts(context)
    stopper = Stopper(context, position, checkpointer)
    assert stopper.decide() == (False, False), "no agreement before the loop begins"
    stopper.begin()
    context.signals.received.add(signal.SIGUSR1)
    assert stopper.decide() == (True, False)
    position.global_step = 12
    with pytest.raises(Stopped) as stopped:
        stopper.stop()
    assert (stopped.value.step, stopped.value.requeued) == (12, False)
    assert position.stopped and tracker.ended == ["KILLED"]
    assert list_checkpoints(checkpoint_dir(context.run_dir))[0].name == "step-000000012"
    stopper.close()


def test_an_optimizer_stepping_a_registered_model_unregistered_is_named_at_its_first_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Said once, naming the optimizer, at its first step; never for weights updated by
    hand (no optimizer state to lose), an optimizer that is registered or held by a
    registered object (ZeroRedundancyOptimizer keeps its inner one), or one that steps no
    registered model."""

    def said_after(register: dict[str, Any], steps: list[torch.optim.Optimizer]) -> list[str]:
        context = context_in(tmp_path / str(len(list(tmp_path.iterdir()))))
        context.registry.add({k: v for k, v in register.items() if ":" not in k})
        context.registry.add(
            {k.split(":")[1]: v for k, v in register.items() if ":" in k}, per_rank=True
        )
        _position, _streams, checkpointer = parts(context)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hpc_ddp"):
            checkpointer.resume(None)
            for optimizer in steps * 2:
                optimizer.step()
        checkpointer.close()
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    model, other = torch.nn.Linear(3, 2), torch.nn.Linear(3, 1)
    adam, apart = torch.optim.AdamW(model.parameters()), torch.optim.SGD(other.parameters())

    [said] = said_after({"model": model}, [apart, adam])
    assert said.startswith(
        "an optimizer (AdamW) steps the registered model but is not registered: a resume "
        "restarts its state"
    ), said
    assert "HINT: run.register(model=model, optimizer=optimizer" in said
    with torch.no_grad():  # a manual SGD step: nothing to register
        model.weight.sub_(0.1)
    assert said_after({"model": model}, []) == []
    assert said_after({"model": model, "optimizer": adam}, [adam]) == []
    wrapping = torch.optim.SGD(model.parameters())
    assert said_after({"model": model, "optimizer": wrapping}, [adam]) != [], "another one"
    wrapping.optim = adam  # type: ignore[attr-defined]  # as ZeroRedundancyOptimizer keeps it
    assert said_after({"model": model, "optimizer": wrapping}, [adam]) == []
    schedule = torch.optim.lr_scheduler.StepLR(adam, 1)  # keeps its optimizer, not its state
    [forgotten] = said_after({"model": model, "scheduler": schedule}, [adam])
    assert forgotten.startswith("an optimizer (AdamW) steps the registered model"), forgotten
    assert said_after({"model": model}, [apart]) == []
    assert said_after({"model": model, "per_rank:optimizer": adam}, [adam]) == []
    assert said_after({}, []) == [
        "nothing is registered for checkpoints: a resumed run could not restore its model. "
        "HINT: run.register(model=model, optimizer=optimizer) before training"
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hpc_ddp"):
        torch.optim.SGD(model.parameters()).step()
    assert caplog.records == [], "the hook ended with its run"


def test_a_wrapped_model_left_unregistered_is_named_before_training(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A GAN's second network given to run.wrap but not to run.register: a checkpoint would
    leave out its weights. Not said of a model registered through its wrapper, inside a
    registered container or an object of the script's own, per rank, or of a frozen one (a
    teacher: nothing to lose); said of one whose head alone is left out."""
    from hpc_ddp.runtime.checkpoint.unregistered import unregistered_models_hint

    generator, critic = torch.nn.Linear(3, 2), torch.nn.Sequential(torch.nn.Linear(2, 1))
    context = context_in(tmp_path)
    context.wrapped.extend([generator, critic])
    context.registry.add(
        {"generator": generator, "optimizer": torch.optim.SGD(generator.parameters())}
    )
    _position, _streams, checkpointer = parts(context)
    with caplog.at_level(logging.INFO, logger="hpc_ddp"):
        checkpointer.resume(None)
    checkpointer.close()
    [said] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said.startswith(
        "a model given to run.wrap (the 2nd: Sequential, 3 parameters) is not registered: a "
        "checkpoint leaves out its weights"
    ), said
    assert "HINT: register every model trained and its optimizer" in said

    class Wrapper(torch.nn.Module):  # as DistributedDataParallel keeps it: .module
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    class GanState:  # an object of the script's own holding both networks
        def __init__(self) -> None:
            self.generator, self.critic = generator, critic

        def state_dict(self) -> dict[str, Any]:
            return {}

    both = torch.nn.ModuleDict({"generator": generator, "critic": critic})
    for registered in (
        {"g": generator, "c": Wrapper(critic)},
        {"both": both},
        {"c": critic[0], "g": generator},
        {"gan": GanState()},
    ):
        assert unregistered_models_hint(registered, [generator, critic]) is None, registered
    teacher = torch.nn.Linear(3, 3).requires_grad_(False)
    assert unregistered_models_hint({"g": generator}, [generator, teacher]) is None
    tied = torch.nn.Sequential(generator, torch.nn.Linear(2, 2))  # shares the generator
    assert "(the 2nd: Sequential, 14 parameters) is not registered" in str(
        unregistered_models_hint({"g": generator}, [generator, tied])
    )
    both_said = str(unregistered_models_hint({"state": torch.nn.Linear(1, 1)}, [generator, critic]))
    assert both_said.startswith(
        "models given to run.wrap (the 1st: Linear, 8 parameters; the 2nd: Sequential, 3 "
        "parameters) are not registered: a checkpoint leaves out their weights"
    ), both_said


def test_the_own_command_is_given_only_where_typing_it_again_runs_the_program(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hpc_ddp.runtime.loop.stopper import own_command

    monkeypatch.setattr(sys, "orig_argv", ["python", "train.py", "--n", "2"])
    monkeypatch.setattr(sys, "argv", ["train.py", "--n", "2"])
    assert own_command() == ["python", "train.py", "--n", "2"]
    for argv in ([""], ["-"]):  # the interactive prompt; a program read from standard input
        monkeypatch.setattr(sys, "argv", argv)
        assert own_command() == ()
    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    assert own_command() == ()


def test_run_state_values_are_compared_between_ranks_by_digest() -> None:
    from hpc_ddp.runtime.checkpoint.fingerprint import rank_differences, value_digest

    grid = torch.arange(6.0).reshape(2, 3)
    assert value_digest(grid.t()) == value_digest(grid.t().contiguous())
    assert value_digest(grid) != value_digest(grid.double())
    assert value_digest(grid) != value_digest(grid.reshape(3, 2)), "the shape counts"
    assert value_digest({"b": [1, (2.5, "x")], "a": None}) == value_digest(
        {"a": None, "b": [1, (2.5, "x")]}
    )
    assert value_digest(0.1 + 0.2) != value_digest(0.3), "floats compared exactly"
    assert value_digest(torch.tensor(1.0, dtype=torch.bfloat16)) != value_digest(torch.tensor(2.0))
    members = [f"member{index}" for index in range(50)]
    assert value_digest(set(members)) == value_digest(set(reversed(members))), "not hash order"
    assert value_digest(grid.to_sparse()) == value_digest(grid), "by its values"
    assert value_digest((grid + 1).to_sparse()) != value_digest(grid.to_sparse())
    complex_grid = torch.complex(grid, grid)
    assert value_digest(complex_grid.conj()) == value_digest(complex_grid.conj().resolve_conj())
    rank0 = (["hidden"], {"lr": "a", "seen": "s0", "best": "b"})
    rank1 = (["hidden"], {"lr": "a", "seen": "s1", "best": "b", "extra": "e"})
    assert rank_differences([rank0, rank1]) == ("", ["extra", "seen"])
    assert rank_differences([rank0, (["other"], rank0[1])]) == (
        "rank 0: hidden; rank 1: other",
        [],
    )


def test_the_way_to_continue_keeps_the_settings_already_in_the_environment() -> None:
    environ = {"HPC_DDP_OVERRIDES": "train.epochs=3 'run.name=a b'"}
    assert continue_hint("x1", False, environ, ["python", "t.py", "--n", "2"]) == (
        "to continue: HPC_DDP_OVERRIDES='train.epochs=3 '\"'\"'run.name=a b'\"'\"' run.id=x1' "
        "python t.py --n 2"
    )
    assert continue_hint("x1", False, {}) == (
        "to continue, run the same command with HPC_DDP_OVERRIDES=run.id=x1 before it (or "
        "run.id=x1 among its settings, where the script hands them to hpc_ddp)"
    )
    assert continue_hint("x1", True, environ, ["python", "t.py"]) == (
        "to continue, run the same command with run.id=x1"
    )


def test_without_checkpoints_a_stop_says_a_run_again_starts_over_and_does_not_requeue(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A requeued attempt without a checkpoint would compute the same steps again, and be
    stopped by the same time limit: the warning signal ends the job instead, and no line
    says "after a checkpoint" or how to continue."""
    tracker = Recorder()
    context = context_in(tmp_path, tracker, checkpoints=False)
    position, _streams, checkpointer = parts(context)
    stopper = Stopper(context, position, checkpointer)
    stopper.begin()
    context.signals.received.add(signal.SIGUSR1)  # the warning signal: asks for a requeue
    assert context.signals.wants_requeue
    position.global_step = 12
    with caplog.at_level(logging.INFO, logger="hpc_ddp"), pytest.raises(Stopped) as stopped:
        stopper.stop()
    stopper.close()
    said = [record.getMessage() for record in caplog.records]
    assert said == [
        "not requeueing: checkpoint.enabled=false, so another attempt would start again from "
        "step 0",
        "stopped at step 12 without a checkpoint (checkpoint.enabled=false): the same command "
        "again starts from step 0",
    ]
    assert (stopped.value.step, stopped.value.requeued, stopped.value.checkpointed) == (
        12, False, False
    )  # fmt: skip
    assert stopped.value.code == EXIT_STOPPED
    assert tracker.ended == ["KILLED"]
    assert not checkpoint_dir(context.run_dir).exists() or not list_checkpoints(
        checkpoint_dir(context.run_dir)
    )


def test_per_rank_states_of_another_world_size_are_not_forced_on_a_stream(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    streams = StreamStates(rank=0, world_size=2)
    streams.restore([{"position": 5}, {"position": 6}, {"position": 7}], saved_world_size=3)
    counting = Counting()
    with caplog.at_level(logging.INFO, logger="hpc_ddp"):
        streams.take(BatchStream(counting, grad_accum_steps=1), resumed_from_step=9)
    assert counting.position == 0
    assert streams.own_state() == {"position": 0}
    said = [record.getMessage() for record in caplog.records]
    assert len(said) == 1 and "starts from its own beginning" in said[0]
    assert not any("resuming the batches" in line for line in said), "no line saying otherwise"


def test_the_random_streams_are_said_restored_only_when_they_were(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """At another world size each rank's streams are seeded anew (the resume warns so):
    no line may then say they were restored."""
    lines = []
    for saved_world_size in (2, 3):
        streams = StreamStates(rank=0, world_size=2)
        streams.restore(None, saved_world_size=saved_world_size)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hpc_ddp"):
            streams.take(BatchStream(Ticks(), grad_accum_steps=1), resumed_from_step=9)
        lines.append([record.getMessage() for record in caplog.records])
    assert len(lines[0]) == 1 and "random streams" in lines[0][0] and "restored" in lines[0][0]
    assert lines[1] == []


def test_a_resumed_sequence_of_steps_is_said_passed_over_with_no_loader_hint(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A ``range`` of offsets into a token stream (truncated BPTT) has no loader whose
    skipping the resume line could suggest."""
    for batches in (range(0, 400, 35), [1, 2, 3]):
        streams = StreamStates(rank=0, world_size=1)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hpc_ddp"):
            streams.take(BatchStream(batches, grad_accum_steps=1), resumed_from_step=2)
        [said] = [record.getMessage() for record in caplog.records]
        assert said.startswith(
            f"resuming the batches at step 2: {type(batches).__name__}: the micro-batches of "
            "the epoch already trained on are passed over"
        ), said
        assert "run.train_loader" not in said and "sampler" not in said


def test_a_dataloader_taken_as_steps_draws_from_torchs_random_stream_only_when_iterated() -> None:
    """A DataLoader's iter() draws its seed from torch's random stream. The stream is saved in
    each checkpoint; a draw at run.steps() besides the one of the epoch's pass would move it
    one draw further in a run resumed mid-epoch than in the run never stopped (its dropout
    masks would differ). A replayed epoch draws nothing that stays."""
    from torch.utils.data import DataLoader

    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2)
    torch.manual_seed(0)
    stream = BatchStream(loader, grad_accum_steps=1)
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(0).get_state())
    assert not stream.endless and stream.steps_per_epoch == 4
    assert BatchStream((batch for batch in loader), grad_accum_steps=1).endless

    class FreshPasses:  # __next__ too, but each iter() a new pass: not one endless epoch
        def __iter__(self) -> Iterator[int]:
            return iter(range(4))

        def __next__(self) -> int:
            return 0

        def __len__(self) -> int:
            return 4

    assert not BatchStream(FreshPasses(), grad_accum_steps=1).endless

    torch.manual_seed(0)
    straight = iter(stream)  # the epoch's pass draws its seed
    next(straight), next(straight)
    at_checkpoint = torch.get_rng_state()
    torch.set_rng_state(at_checkpoint)  # as a resume restores it
    resumed = BatchStream(loader, grad_accum_steps=1)
    resumed.set_position(epoch=0, step=2)
    replayed = iter(resumed)
    assert torch.equal(torch.get_rng_state(), at_checkpoint)
    assert [batch[0].tolist() for batch in replayed] == [[4.0, 5.0], [6.0, 7.0]]


def test_labelled_lines_are_written_whole_in_one_call() -> None:
    """What a rank's unbuffered print does (text, then the newline) reaches the stream as
    one write per line."""
    from hpc_ddp.launch.output import LabelledLines

    class Recorder:
        def __init__(self) -> None:
            self.writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    recorder = Recorder()
    stream = LabelledLines(recorder, "[rank 1] ")  # type: ignore[arg-type]
    for piece in ["one", "\n", "two\nthr", "ee\n", "partial"]:
        stream.write(piece)
    assert recorder.writes == ["[rank 1] one\n", "[rank 1] two\n", "[rank 1] three\n"]
    stream.flush()
    stream.write(" ends\n")
    assert recorder.writes[3:] == ["[rank 1] partial", " ends\n"]


def test_ranks_take_turns_through_the_lock_file_to_write_a_line(tmp_path: Path) -> None:
    """While a rank writes a line it holds the launcher's lock file: another rank (its own
    descriptor of the file) cannot take it then, and can between lines."""
    import fcntl
    import os

    from hpc_ddp.launch.output import LabelledLines

    lock_path = tmp_path / "output.lock"
    lock_path.touch()
    other_rank = os.open(lock_path, os.O_RDONLY)
    held_while_writing: list[bool] = []

    class Stream:
        def write(self, text: str) -> int:
            try:
                fcntl.flock(other_rank, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held_while_writing.append(True)
            else:
                fcntl.flock(other_rank, fcntl.LOCK_UN)
                held_while_writing.append(False)
            return len(text)

        def flush(self) -> None:
            pass

    stream = LabelledLines(Stream(), "", str(lock_path))  # type: ignore[arg-type]
    stream.write("a long line\nanother\n")
    stream.write("partial")
    stream.flush()
    fcntl.flock(other_rank, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free between lines
    os.close(other_rank)
    assert held_while_writing == [True, True]


def test_doctor_lines_stay_under_a_kilobyte_each_labelled() -> None:
    from hpc_ddp.launch.doctor import labelled_pieces, report_path

    text = "é" * 300 + "\nHINT: " + "x" * 2500
    pieces = labelled_pieces("[doctor rank 3/4]", text)
    assert all(len(piece.encode()) <= 1000 for piece in pieces)
    assert all(piece.startswith("[doctor rank 3/4] ") for piece in pieces), "the HINT too"
    shown = [piece.removeprefix("[doctor rank 3/4] ") for piece in pieces]
    assert shown[0] == "é" * 300 and shown[1].startswith("HINT: ")
    assert "".join(piece.removeprefix("... ") for piece in shown[1:]) == "HINT: " + "x" * 2500
    folder = Path("reports")
    assert report_path(folder, {"rank": 5}, {}) == folder / "doctor-rank-5.json"
    # A plan that failed names no rank: torchrun's RANK, not SLURM_PROCID (a node's task).
    unplanned = report_path(folder, {}, {"RANK": "3", "SLURM_PROCID": "1"})
    assert unplanned == folder / "doctor-rank-3.json"
    assert report_path(folder, {}, {"SLURM_PROCID": "1"}) == folder / "doctor-rank-1.json"


def test_a_rehearsed_stop_is_the_warning_signal_and_a_leaving_rank_ignores_stops() -> None:
    import signal

    from hpc_ddp.runtime.preempt.signals import StopSignals, ignored_after_the_run

    rehearsed = StopSignals("USR1")
    rehearsed.rehearse()
    assert rehearsed.requested and rehearsed.wants_requeue, "a requeue, as the signal asks"
    before = {number: signal.getsignal(number) for number in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        StopSignals("USR1").ignore_from_now_on()
        assert signal.getsignal(signal.SIGUSR1) is ignored_after_the_run
        assert signal.getsignal(signal.SIGTERM) is ignored_after_the_run
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)


@pytest.mark.e2e
def test_a_forked_child_does_not_hold_the_parents_run() -> None:
    """A process the user's code forks (os.fork, then its own exit) would run the exit
    handlers and end the parent's run (MLflow FAILED through the shared tracking pipe); in
    the child the run is not held. The child leaves with os._exit: torch's own exit in a
    forked child of a process with a gloo group can hang, whoever forked it."""
    from hpc_ddp.runtime.session import ending

    ending._ACTIVE.append(object())  # type: ignore[arg-type]  # stands for the parent's run
    try:
        child = os.fork()
        if child == 0:
            os._exit(10 + len(ending._ACTIVE))
        _pid, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 10, "the child holds no run"
        assert len(ending._ACTIVE) == 1, "the parent still does"
    finally:
        ending._ACTIVE.pop()


def test_evaluation_for_a_sharded_model_gives_every_rank_as_many_batches() -> None:
    """5 samples, 2 ranks, 2 a batch: rank 0 holds 3 (2 batches), rank 1 holds 2, which it
    takes in 2 batches too (not 1), so both run two forward passes; nothing is counted
    twice, and no batch is empty (a model may not take one)."""
    data = TensorDataset(torch.arange(5.0))
    shares = [
        [batch[0].tolist() for batch in eval_loader(
            data, rank=rank, world_size=2, batch_size=2, num_workers=0, device=None,
            same_count=True,
        )]
        for rank in (0, 1)
    ]  # fmt: skip
    assert shares == [[[0.0, 2.0], [4.0]], [[1.0], [3.0]]]
    plain = eval_loader(data, rank=1, world_size=2, batch_size=2, num_workers=0, device=None)
    assert len(plain) == 1 and len(list(plain)) == 1, "a replicated model needs no filler"


def test_an_evaluation_loader_is_laid_out_for_a_model_sharded_by_its_first_use() -> None:
    """A script may shard its model itself and register it after making its loaders: the
    layout is asked for again at the first iteration, then kept."""
    data = TensorDataset(torch.arange(5.0))

    def build(same_count: bool) -> Any:
        return eval_loader(data, rank=1, world_size=2, batch_size=2, num_workers=0,
                           device=None, same_count=same_count)  # fmt: skip

    sharded = [False]
    later = EvalBatches(build, lambda: sharded[0], AttemptTimes())
    never = EvalBatches(build, lambda: False, AttemptTimes())
    sharded[0] = True  # the model was sharded and registered after the loader was made
    assert [batch[0].tolist() for batch in later] == [[1.0], [3.0]], "as many as rank 0"
    assert len(later) == 2 and len(never) == 1
    sharded[0] = False
    assert len(later) == 2, "chosen at the first use, then kept"


def test_a_rank_with_no_evaluation_samples_still_runs_as_many_passes() -> None:
    """One sample, two ranks: rank 1's share is empty, and it still gets one (empty) batch,
    built from a sample and cut to none; a batch in a dict subclass or a namedtuple is cut
    whole, never handed out again as it was."""
    data = TensorDataset(torch.arange(1.0))
    empty = list(eval_loader(data, rank=1, world_size=2, batch_size=2, num_workers=0,
                             device=None, same_count=True))  # fmt: skip
    assert len(empty) == 1 and empty[0][0].shape == (0,)

    class Encoding(dict):  # type: ignore[type-arg]
        """Like a tokenizer's BatchEncoding: a dict subclass."""

    Pair = collections.namedtuple("Pair", ["x", "y"])
    batch = {"enc": Encoding(ids=torch.ones(3, 2)), "pair": Pair(torch.ones(3), [torch.ones(3)])}
    cut = no_samples(batch)
    assert cut["enc"]["ids"].shape == (0, 2)
    assert isinstance(cut["pair"], Pair) and cut["pair"].x.shape == (0,)
    assert cut["pair"].y[0].shape == (0,)
    assert type(cut["enc"]) is Encoding


@dataclasses.dataclass
class Tokens:
    """A user's batch as a dataclass (a common shape for language-model batches)."""

    ids: torch.Tensor
    mask: torch.Tensor
    source: str = "train"


def test_a_dataclass_batch_is_cut_to_no_samples_and_its_samples_counted() -> None:
    """The filler batch of a rank with no evaluation samples is the dataclass with every
    tensor cut, not the sample it was built from: that sample would be counted twice."""
    data = TensorDataset(torch.arange(3.0).reshape(1, 3))

    def collate(samples: list[tuple[torch.Tensor]]) -> Tokens:
        ids = torch.stack([sample[0] for sample in samples])
        return Tokens(ids=ids, mask=torch.ones_like(ids), source="val")

    (filler,) = eval_loader(data, rank=1, world_size=2, batch_size=2, num_workers=0,
                            device=None, collate_fn=collate, same_count=True)  # fmt: skip
    assert isinstance(filler, Tokens) and filler.source == "val"
    assert filler.ids.shape == (0, 3) and filler.mask.shape == (0, 3)
    assert batch_length(filler) == 0
    assert batch_length(Tokens(ids=torch.ones(5, 2), mask=torch.ones(5, 2))) == 5
    # A scalar in a batch (a loss weight) stays; a defaultdict comes back as a dict.
    cut = no_samples({"w": torch.tensor(2.0), "d": collections.defaultdict(list, x=torch.ones(3))})
    assert cut["w"].item() == 2.0 and cut["d"]["x"].shape == (0,)


def folders_at_steps_10_and_20(tmp_path: Path, model: torch.nn.Module) -> Path:
    """A run's checkpoints folder holding the folder checkpoints of steps 10 and 20 of
    ``model``."""
    context = context_in(tmp_path, save_mode="sync")
    context.registry.add({"model": model})
    position, _streams, checkpointer = parts(context)
    for step in (10, 20):
        position.global_step = step
        checkpointer.save("periodic")
    return checkpoint_dir(context.run_dir)


@pytest.mark.parametrize(
    "damage", ["truncated", "missing", "outside", "flipped", "foreign", "zeroed-unchecked"]
)
def test_a_folder_whose_files_do_not_match_its_metadata_is_set_aside_for_the_one_before(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A shard file cut short (a full disk, a copy that stopped), gone, a metadata that
    names a file outside its folder, one bit flipped, or the same file of another
    checkpoint (same size, other weights): the newest folder is no checkpoint, the one
    before it is resumed from and the damaged one kept in checkpoints/unreadable/."""
    from hpc_ddp.runtime.checkpoint.sharded.layout import METADATA

    directory = folders_at_steps_10_and_20(tmp_path, torch.nn.Linear(64, 64))
    newest = directory / "step-000000020"
    shard = max(newest.glob("*.distcp"), key=lambda path: path.stat().st_size)
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "missing":
        shard.unlink()
    elif damage == "flipped":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
    elif damage == "foreign":
        shard.write_bytes((directory / "step-000000010" / shard.name).read_bytes())
    elif damage == "zeroed-unchecked":  # no checksum to catch it: DCP's read fails
        (newest / f"{shard.name}.sha256").unlink()
        shard.write_bytes(bytes(shard.stat().st_size))
    else:
        metadata = (newest / METADATA).read_bytes()
        (newest / METADATA).write_bytes(
            metadata.replace(shard.name.encode(), b"../" + shard.name[3:].encode())
        )
    with caplog.at_level(logging.WARNING, logger="hpc_ddp"):
        path, saved = load_newest(directory)  # type: ignore[misc]
    assert path.name == "step-000000010" and saved["global_step"] == 10
    assert (directory / "unreadable" / "step-000000020").is_dir()
    said = {
        "truncated": f"{shard.name} holds 100 bytes, its metadata reaches byte",
        "missing": f"{shard.name} is missing",
        "outside": "a file outside the folder",
        "flipped": f"{shard.name} does not match its checksum ({shard.name}.sha256)",
        "foreign": f"{shard.name} does not match its checksum",
        "zeroed-unchecked": "CheckpointException",
    }
    assert said[damage] in caplog.text


def test_each_file_of_a_folder_has_a_sha256sum_line_and_a_folder_without_them_loads(
    tmp_path: Path,
) -> None:
    """The checksums are sha256sum's lines, one per data file, of the bytes on disk (small
    writes hashed in line, a 2 MB tensor beside its write); a folder written before
    checksums were kept loads as it is, but one whose files are checked only in part is
    damaged."""
    import hashlib

    from hpc_ddp.runtime.checkpoint.checksums import check_checksums

    context = context_in(tmp_path, save_mode="sync")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(1024, 512))
    context.registry.add({"model": model})
    position, _streams, checkpointer = parts(context)
    position.global_step = 10
    checkpointer.save("periodic")
    folder = checkpoint_dir(context.run_dir) / "step-000000010"
    shards = sorted(folder.glob("*.distcp"))
    assert shards and sorted(folder.glob("*.distcp.sha256")) == [
        shard.with_name(f"{shard.name}.sha256") for shard in shards
    ]
    for shard in shards:
        digest = hashlib.sha256(shard.read_bytes()).hexdigest()
        assert shard.with_name(f"{shard.name}.sha256").read_text() == f"{digest}  {shard.name}\n"
    for shard in shards:
        shard.with_name(f"{shard.name}.sha256").unlink()
    path, saved = load_newest(checkpoint_dir(context.run_dir))  # type: ignore[misc]
    assert path == folder and saved["global_step"] == 10
    (folder / "other.distcp").write_bytes(b"x")
    (folder / "other.distcp.sha256").write_text(
        f"{hashlib.sha256(b'x').hexdigest()}  other.distcp\n"
    )
    check_checksums(folder, ["other.distcp"])
    with pytest.raises(ValueError, match=f"{shards[0].name} has no checksum, while the folder"):
        check_checksums(folder, [shards[0].name, "other.distcp"], (1, 2))  # not its share's

    # Shared between ranks: each reads every n-th file; a changed file fails its share only.
    (folder / "another.distcp").write_bytes(b"y")
    (folder / "another.distcp.sha256").write_text(
        f"{hashlib.sha256(b'x').hexdigest()}  another.distcp\n"
    )
    names = ["another.distcp", "other.distcp"]
    check_checksums(folder, names, (1, 2))
    with pytest.raises(ValueError, match=r"another\.distcp does not match its checksum"):
        check_checksums(folder, names, (0, 2))


def test_an_export_reads_the_newest_when_the_run_prunes_the_one_it_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`hpc-ddp export` beside a run that goes on: the run saves step 40 and prunes step 30
    (keep_last=1) between the export's choice of step 30 and its read; the export then
    reads step 40. A pruned folder is renamed out of the list before it is removed, so no
    reader sees it half gone; a kill mid-removal leaves nothing a start would not remove."""
    from hpc_ddp.runtime.checkpoint import export
    from hpc_ddp.runtime.checkpoint.files import prune_older, remove_partial_writes

    context = context_in(tmp_path, save_mode="sync")
    model = torch.nn.Linear(4, 4)
    context.registry.add({"model": model})
    position, _streams, checkpointer = parts(context)
    directory = checkpoint_dir(context.run_dir)
    position.global_step = 30
    checkpointer.save("periodic")
    real, chosen = export.model_weights, []

    def run_saves_and_prunes_first(path: Path, name: str | None = None) -> Any:
        chosen.append(path.name)
        if len(chosen) == 1:
            with torch.no_grad():
                model.weight.add_(1.0)
            position.global_step = 40
            checkpointer.save("periodic")
            prune_older(directory, 40, keep_last=1)
            assert [path.name for path in list_checkpoints(directory)] == ["step-000000040"]
            assert not list(directory.glob(".pruned-*")), "removed once renamed"
        return real(path, name)

    monkeypatch.setattr(export, "model_weights", run_saves_and_prunes_first)
    path, name, weights = export.read_model_weights(context.run_dir)
    assert chosen == ["step-000000030", "step-000000040"] and path.name == "step-000000040"
    assert name == "model" and torch.equal(weights["weight"], model.weight)

    def run_saves_and_prunes(path: Path, name: str | None = None) -> Any:
        chosen.append(path.name)
        position.global_step = 60
        checkpointer.save("periodic")
        prune_older(directory, 60, keep_last=1)
        return real(path, name)

    chosen.clear()
    position.global_step = 50
    checkpointer.save("periodic")
    monkeypatch.setattr(export, "model_weights", run_saves_and_prunes)
    with pytest.raises(HpcDdpError, match="step-000000050 was removed while it was read"):
        export.read_model_weights(context.run_dir, step=50)
    assert chosen == ["step-000000050"]
    monkeypatch.setattr(export, "model_weights", real)
    (directory / "step-000000060" / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(HpcDdpError, match=r"cannot read checkpoint .*step-000000060: "):
        export.read_model_weights(context.run_dir)

    left = directory / ".pruned-step-000000020"
    (left / "x").mkdir(parents=True)
    remove_partial_writes(directory)
    assert not left.exists()
    (directory / ".pruned-step-000000060" / "x").mkdir(parents=True)  # a kill left it
    position.global_step = 70
    checkpointer.save("periodic")
    prune_older(directory, 70, keep_last=1)
    assert [path.name for path in list_checkpoints(directory)] == ["step-000000070"]


def test_a_folder_that_fails_to_read_at_restore_is_one_line_with_the_way_on(
    tmp_path: Path,
) -> None:
    """torch's CheckpointException is a BaseException: a shard that goes away between the
    choice of the checkpoint and the restore is still an HpcDdpError saying how to go on."""
    context = context_in(tmp_path, save_mode="sync")
    context.registry.add({"model": torch.nn.Linear(64, 64)})
    position, _streams, checkpointer = parts(context)
    position.global_step = 10
    checkpointer.save("periodic")
    path, saved = load_newest(checkpoint_dir(context.run_dir))  # type: ignore[misc]
    for shard in path.glob("*.distcp"):
        shard.unlink()
    again = context_in(tmp_path / "again")
    again.registry.add({"model": torch.nn.Linear(64, 64)})
    with pytest.raises(HpcDdpError, match="its files do not read") as refused:
        restore_registered(again.registry, saved["objects"], path)
    assert f"move {path.name} into" in refused.value.hint
    assert "most likely failed this read: run again" in refused.value.hint


def test_a_share_that_does_not_read_keeps_the_folder_and_a_changed_one_sets_it_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks' shared check (here a world of one): a file that fails to read (EIO, which
    a disk here cannot be made to give: the read is replaced) refuses the run in one line
    and keeps every checkpoint; bytes that differ from their checksum set the folder aside
    for the one before."""
    import errno
    import functools

    from hpc_ddp.runtime.checkpoint import checksums
    from hpc_ddp.runtime.checkpoint.loading import _check_together

    directory = folders_at_steps_10_and_20(tmp_path, torch.nn.Linear(8, 8))
    newest = directory / "step-000000020"
    (shard,) = newest.glob("*.distcp")
    verify = functools.partial(_check_together, group=None)

    def failing_read(path: Path) -> str:
        raise OSError(errno.EIO, "Input/output error", str(path))

    with monkeypatch.context() as patched:
        patched.setattr(checksums, "file_sha256", failing_read)
        with pytest.raises(
            HpcDdpError, match="1 rank\\(s\\) could not read their share"
        ) as refused:
            load_newest(directory, verify=verify)
    assert "Input/output error" in refused.value.message
    assert "the checkpoint is kept" in refused.value.hint
    assert [path.name for path in list_checkpoints(directory)] == [
        "step-000000020",
        "step-000000010",
    ]

    kept = shard.read_bytes()
    shard.write_bytes(bytes([kept[0] ^ 1]) + kept[1:])
    path, _saved = load_newest(directory, verify=verify)  # type: ignore[misc]
    assert path.name == "step-000000010"
    assert (directory / "unreadable" / "step-000000020").is_dir()


def test_a_checkpoint_that_other_ranks_cannot_read_is_one_line_and_kept(tmp_path: Path) -> None:
    """Rank 0 chose the checkpoint and read it whole: where other ranks' reads fail, every
    rank ends with the same line naming them, and nothing is set aside."""
    from hpc_ddp.runtime.checkpoint.loading import refuse_unless_read_everywhere

    path = tmp_path / "step-000000010"
    refuse_unless_read_everywhere(path, [None, None, None])
    with pytest.raises(HpcDdpError) as refused:
        refuse_unless_read_everywhere(path, [None, "n2: __1_0.distcp is missing", None])
    assert "read on rank 0 but not on 1 other rank(s): rank 1 on n2: __1_0.distcp" in str(
        refused.value
    )
    assert "the checkpoint is kept" in refused.value.hint


class MetricsRecorder(NullTracker):
    """A tracker that keeps every metric logged, with its step."""

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.logged.append((step, dict(metrics)))


def test_time_outside_an_epochs_steps_is_not_charged_to_its_first_interval(
    tmp_path: Path,
) -> None:
    tracker = MetricsRecorder()
    context = context_in(tmp_path, tracker)
    log = MetricLog(context)
    try:
        context.times.evaluation_s += 30.0  # the last epoch's evaluation, outside run.steps
        log.use_loader([])  # the next epoch's steps begin: its interval's clock starts here
        context.times.checkpoint_s += 0.5  # a save inside the interval
        log.close_interval(step=4, epoch=1, steps=4, seconds=2.0)
        log.publish()
    finally:
        log.close()
    [(step, metrics)] = [item for item in tracker.logged if "interval/lr" not in item[1]]
    assert step == 4
    assert metrics["interval/evaluation_percent"] == 0.0
    assert metrics["interval/checkpoint_percent"] == 25.0


def test_an_interval_with_a_suspension_has_its_rate_and_no_step_time_shares(
    tmp_path: Path,
) -> None:
    tracker = MetricsRecorder()
    context = context_in(tmp_path, tracker)
    log = MetricLog(context)
    try:
        log.use_loader([])
        log.close_interval(step=4, epoch=0, steps=4, seconds=2.0)
        log.close_interval(step=8, epoch=0, steps=4, seconds=2.0, suspended_s=60.0)
        log.publish()
    finally:
        log.close()
    ran, suspended = [metrics for _, metrics in tracker.logged if "interval/lr" not in metrics]
    assert ran["interval/steps_per_s"] == suspended["interval/steps_per_s"] == 2.0
    assert "interval/checkpoint_percent" in ran
    assert not [
        name for name in suspended if name.startswith("interval/") and name.endswith("_percent")
    ], "the stop would count as the step part it fell in"


def test_a_closing_log_leaves_no_global_optimizer_hook_behind(tmp_path: Path) -> None:
    from torch.optim import optimizer

    before = (
        len(optimizer._global_optimizer_pre_hooks),
        len(optimizer._global_optimizer_post_hooks),
    )
    log = MetricLog(context_in(tmp_path))
    assert len(optimizer._global_optimizer_pre_hooks) == before[0] + 1, "the step is timed"

    def broken() -> None:
        raise OSError("the terminal went away")

    log.progress.close = broken  # type: ignore[method-assign]
    with pytest.raises(OSError):
        log.close()
    after = (
        len(optimizer._global_optimizer_pre_hooks),
        len(optimizer._global_optimizer_post_hooks),
    )
    assert after == before, "a later run in this process would be timed twice"


def test_what_ended_a_rank_is_recorded_once_the_first_cause_standing(tmp_path: Path) -> None:
    """A rank the watchdog found stalled inside a collective, whose collective then fails as
    its peer leaves, ended once: the second thread's record is not a second failure."""
    context = context_in(tmp_path)
    stalled = {"error": "stalled: no training step finished", "at": None,
               "follows_another_rank": True}  # fmt: skip
    lost = {"error": "another rank went away during a collective", "at": None,
            "follows_another_rank": True}  # fmt: skip
    context.record_failure(stalled, 7)
    context.record_failure(lost, 8)
    recorded = read_failures(context.run_dir)
    assert [(line["error"], line["step"], line["rank"]) for line in recorded] == [
        ("stalled: no training step finished", 7, 0)
    ]
