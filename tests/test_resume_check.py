"""What `hpc-ddp check-resume` makes of two runs' saved state and logged metrics, in this
process: which values count as different, and the likely cause it names for each kind of
difference. The command on real ranks, with a script per mistake: test_check_resume.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpc_ddp.cli.app import main
from hpc_ddp.cli.check_resume import check_environment
from hpc_ddp.launch.rank_exits import stop_code
from hpc_ddp.runtime.errors import EXIT_STOPPED
from hpc_ddp.view.resume_check import (
    Difference,
    Tolerance,
    differences,
    metric_differences,
)
from hpc_ddp.view.resume_verdict import resume_warnings, verdict

SAVED = {
    "objects.model.weight": torch.ones(2, 2),
    "run.plain.optimizer.param_groups[0].lr": 0.045,
    "run.plain.optimizer.param_groups[0].params[0]": 0,
    "run.global_step": 40,
    "run.train_time_s": 1.5,
    "run.metrics.epoch.loss.total": torch.tensor(3.0),
    "rank.0.rng.torch": torch.arange(4),
    "run.values.best": float("nan"),
}


def test_only_values_that_differ_count_and_times_and_ids_do_not() -> None:
    same = {**SAVED, "objects.model.weight": torch.ones(2, 2), "run.train_time_s": 9.0}
    assert differences(SAVED, same) == [], "equal tensors, NaN equal to NaN, times ignored"
    other = {**SAVED, "objects.model.weight": torch.ones(2, 3), "rank.1.rng.torch": torch.ones(1)}
    del other["run.global_step"]
    assert [found.key for found in differences(SAVED, other)] == [
        "objects.model.weight",
        "run.global_step",
        "rank.1.rng.torch",
    ]
    assert differences(SAVED, other)[1] == Difference("run.global_step", "40", "(none)")


def test_each_kind_of_difference_names_its_likely_cause() -> None:
    exact = verdict([], [], 40, 20)
    assert exact.exact and exact.what == "resume is exact for this script (40 steps, stopped at 20)"

    weights = Difference("objects.model.weight", "a", "b")
    learning_rate = Difference("run.plain.optimizer.param_groups[0].lr", "0.045", "0.05")
    scheduler = verdict([weights, learning_rate], [(21, "interval/loss")], 40, 20)
    assert not scheduler.exact
    assert scheduler.what.startswith("the optimizer's param_groups[0]['lr'] differs after")
    assert scheduler.what.endswith("a learning-rate scheduler is not registered")
    assert "scheduler=scheduler" in scheduler.hint

    position = verdict([Difference("run.step_in_epoch", "3", "0")], [], 40, 20)
    assert position.what.startswith("the data position differs after the resume")

    streams = verdict([Difference("rank.1.rng.torch", "a", "b")], [], 40, 20)
    assert "only the random streams differ" in streams.what

    order = verdict([Difference("run.metrics.epoch.loss.total", "1", "2"), weights],
                    [(21, "interval/loss")], 40, 20)  # fmt: skip
    assert order.what.startswith("objects.model.weight differs after the resume")
    assert "the first logged difference is at step 21" in order.what
    assert "the data order differs" in order.what and "run.train_loader" in order.hint

    counter = verdict([Difference("run.metrics.epoch.seen.total", "1", "2")],
                      [(21, "interval/seen")], 40, 20)  # fmt: skip
    assert counter.what.startswith("the logged metric interval/seen differs at step 21")
    assert counter.what.endswith("the script keeps an unregistered counter or total")


def test_a_warning_of_state_a_resume_gets_wrong_is_named_before_its_effects() -> None:
    """A GAN's second optimizer left unregistered shows first in the other network's
    BatchNorm statistics: the runs' warning names the cause, and its HINT is the check's."""
    forgotten = (
        "an optimizer (Adam) steps the registered netD but is not registered: a resume "
        "restarts its state. HINT: run.register(model=model, optimizer=optimizer)"
    )
    logs = [
        "12:00:01 [rank 0/2] INFO epoch 0 step 20/40\n"
        f"12:00:01 [rank 0/2] WARNING {forgotten}\n"
        "12:00:02 [rank 0/2] WARNING stopped at step 20 after a checkpoint; to continue: ...\n"
        "12:00:02 [rank 0/2] WARNING data waits 40% of the step. HINT: more workers\n",
        f"12:00:05 [rank 0/2] WARNING {forgotten}\n",
    ]
    assert resume_warnings(logs) == [forgotten], "once, and only a warning of lost state"
    buffers = Difference("rank.0.buffers.netG.main.1.running_mean", "0.1", "0.2")
    answer = verdict([buffers], [], 40, 20, warned=resume_warnings(logs))
    assert answer.what == (
        "the runs warned of state a resume gets wrong: an optimizer (Adam) steps the registered "
        "netD but is not registered: a resume restarts its state (1 saved value(s) differ "
        "after the resume, the first rank.0.buffers.netG.main.1.running_mean; 40 steps, "
        "stopped at 20)"
    )
    assert answer.hint == "run.register(model=model, optimizer=optimizer)"
    # A model the checkpoints leave out shows in none of their values.
    critic = (
        "a model given to run.wrap (the 2nd: Critic, 5 parameters) is not registered: a "
        "checkpoint leaves out its weights. HINT: register every model trained"
    )
    unsaved = verdict([], [], 40, 20, warned=[forgotten, critic])
    assert not unsaved.exact and "run.wrap (the 2nd: Critic" in unsaved.what
    assert unsaved.what.endswith(
        "(what the checkpoints hold and the metrics logged agree; 40 steps, stopped at 20)"
    ), unsaved


def test_every_warning_of_lost_state_is_one_the_check_recognises() -> None:
    from torch import nn

    from hpc_ddp.runtime.checkpoint.unregistered import (
        NOTHING_REGISTERED,
        STATE_DIFFERS,
        unregistered_models_hint,
        unregistered_optimizer_hint,
    )
    from hpc_ddp.runtime.loop.data import ITERATED_DIRECTLY
    from hpc_ddp.view.resume_verdict import LOSES_WORK, UNSAVED

    model = nn.Linear(2, 1)
    one, two = nn.Linear(1, 1), nn.Linear(1, 2)
    said = [
        NOTHING_REGISTERED,
        str(unregistered_optimizer_hint({"model": model}, torch.optim.SGD(model.parameters()))),
        STATE_DIFFERS.format(keys="total") + ": a checkpoint keeps rank 0's values",
        ITERATED_DIRECTLY,
    ]
    unsaved = [
        str(unregistered_models_hint({"model": model}, [one])),
        str(unregistered_models_hint({"model": model}, [one, two])),
    ]
    assert all(message.startswith(LOSES_WORK) for message in said + unsaved), said + unsaved
    assert [message.startswith(UNSAVED) for message in said + unsaved] == [False] * 4 + [True] * 2


def test_a_warning_of_state_the_values_show_equal_is_a_note_not_a_failure() -> None:
    """An SGD without momentum left unregistered has no state to lose: its warning does not
    fail an exact resume; a setting's own cause is named before a warning's."""
    sgd = (
        "an optimizer (SGD) steps the registered model but is not registered: a resume "
        "restarts its state. HINT: run.register(model=model, optimizer=optimizer)"
    )
    assert verdict([], [], 40, 20, warned=[sgd]).exact
    learning_rate = Difference("run.plain.optimizer.param_groups[0].lr", "0.04", "0.05")
    named = verdict([learning_rate], [], 40, 20, warned=[sgd])
    assert named.what.startswith("the optimizer's param_groups[0]['lr'] differs"), named


def test_two_states_with_equal_sums_are_told_apart_by_their_first_differing_element() -> None:
    """A random stream's state one draw apart holds the same bytes in another place: its sum
    cannot show the difference, its first differing element does."""
    straight = torch.tensor([[7, 1], [2, 9]], dtype=torch.uint8)
    resumed = torch.tensor([[7, 2], [1, 9]], dtype=torch.uint8)
    found = differences({"rank.0.rng.torch": straight}, {"rank.0.rng.torch": resumed})
    assert found == [
        Difference("rank.0.rng.torch", "tensor[2, 2] sum 19, [0, 1] 1",
                   "tensor[2, 2] sum 19, [0, 1] 2")
    ]  # fmt: skip
    scalar = differences({"x": torch.tensor(1.0)}, {"x": torch.tensor(2.0)})
    assert scalar == [Difference("x", "tensor[] sum 1", "tensor[] sum 2")]
    # A NaN in both is equal; the element is written in full (one float32 ulp apart).
    nan, ulp = float("nan"), torch.nextafter(torch.tensor(0.5), torch.tensor(1.0)).item()
    weights = differences({"w": torch.tensor([nan, 0.5])}, {"w": torch.tensor([nan, ulp])})
    assert [(found.straight, found.resumed) for found in weights] == [
        ("tensor[2] sum nan, [1] 0.5", "tensor[2] sum nan, [1] 0.5000000596046448")
    ]
    # Across sizes: the first element outside the tolerance.
    near = differences(
        {"w": torch.tensor([1.0, 1.0])}, {"w": torch.tensor([1.0000001, 2.0])}, Tolerance(1e-3, 0)
    )
    assert near[0].straight.endswith("[1] 1.0") and near[0].resumed.endswith("[1] 2.0")


def test_weights_and_random_streams_that_differ_are_both_named() -> None:
    """Weights that differ with the random streams: the verdict names the weights first, says
    the streams differ too and never that no random stream does."""
    weights = Difference("objects.model.weight", "a", "b")
    stream = Difference("rank.0.rng.torch", "c", "d")
    both = verdict([stream, weights], [(16, "interval/loss")], 30, 15)
    assert both.what.startswith("objects.model.weight differs after the resume (a never")
    assert "2 saved value(s) differ, the random streams (rank.0.rng.torch) among them" in both.what
    assert "random stream does" not in both.what
    assert "draws random numbers that the resume does not replay" in both.what
    assert "DistributedSampler with set_epoch" in both.hint and "gen=generator" in both.hint


def test_logged_points_differ_by_value_or_by_being_logged_once() -> None:
    straight = {(21, "interval/loss"): 0.5, (22, "interval/loss"): 0.25}
    assert metric_differences(straight, dict(straight)) == []
    assert metric_differences(straight, {(21, "interval/loss"): 0.5}) == [(22, "interval/loss")]
    assert metric_differences({(21, "x"): None}, {(21, "x"): 1.0}) == [(21, "x")]


def test_a_resume_on_another_number_of_ranks_is_compared_within_the_tolerance() -> None:
    """--world-size-change: floating-point values within rtol/atol are equal; integers, the
    position, optimizer settings and metric counts stay exact; each rank's own state and the
    number of ranks are not compared (they cannot carry over)."""
    tolerance = Tolerance(rtol=1e-3, atol=1e-6)
    near = {
        **SAVED,
        "objects.model.weight": torch.ones(2, 2) * (1 + 5e-4),
        "run.metrics.epoch.loss.total": torch.tensor(3.001),
        "rank.0.rng.torch": torch.arange(4) + 1,
        "rank.2.rng.torch": torch.arange(4),
        "run.world_size": 3,
    }
    assert [found.key for found in differences(SAVED, near)][:2] == [
        "objects.model.weight",
        "run.metrics.epoch.loss.total",
    ], "bitwise by default"
    assert differences(SAVED, near, tolerance) == []
    far = {
        **near,
        "objects.model.weight": torch.ones(2, 2) * 1.01,
        "run.plain.optimizer.param_groups[0].lr": 0.045 * (1 + 1e-6),
        "run.global_step": 41,
        "run.metrics.epoch.loss.count": torch.tensor(8008.0, dtype=torch.float64),
        "run.values.best": float("inf"),
    }
    exact = {
        **SAVED,
        "run.metrics.epoch.loss.count": torch.tensor(8000.0, dtype=torch.float64),
        "run.values.best": float("inf"),
    }
    assert [found.key for found in differences(exact, far, tolerance)] == [
        "objects.model.weight",
        "run.plain.optimizer.param_groups[0].lr",
        "run.global_step",
        "run.metrics.epoch.loss.count",
    ], "settings, counts and integers exact; inf equal to inf"
    straight = {(21, "interval/loss"): 0.5, (22, "interval/loss"): None}
    close = {(21, "interval/loss"): 0.5002, (22, "interval/loss"): None}
    assert metric_differences(straight, close) == [(21, "interval/loss")]
    assert metric_differences(straight, close, tolerance) == []
    assert metric_differences(straight, {(21, "interval/loss"): 0.51}, tolerance) == [
        (21, "interval/loss"),
        (22, "interval/loss"),
    ]
    across = "resumed on 1 rank(s) instead of 2, within rtol 0.001, atol 1e-06"
    assert str(tolerance) == "rtol 0.001, atol 1e-06"
    held = verdict([], [], 40, 20, across)
    assert held.exact and held.what == (
        f"resume on another number of ranks holds for this script (40 steps, stopped at 20, "
        f"{across})"
    )
    moved = verdict([Difference("run.global_step", "48", "80")], [], 80, 24, across)
    assert not moved.exact and moved.what.endswith(
        "the script's batches are per rank (a DataLoader of its own), so the global batch "
        "and the steps of an epoch change with the number of ranks"
    ), "a loader of the script's own: not a position run.steps would resume"
    assert moved.hint.startswith("run.train_loader(dataset, global_batch_size) keeps")
    # BatchNorm's statistics of each rank's own batch: other numbers on another world size.
    apart = verdict([Difference("objects.model.bn.running_mean", "0.1", "0.3")], [], 40, 20, across)
    assert apart.what.startswith(
        "objects.model.bn.running_mean differs after the resume beyond the tolerance"
    )
    assert "BatchNorm's statistics of its own batch differ by design" in apart.hint
    assert (
        "loop with run.steps"
        in verdict([Difference("run.global_step", "48", "80")], [], 80, 24).hint
    )


def test_a_folder_holding_an_earlier_checks_runs_is_refused_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second check in the same --output-dir would resume the first one's runs."""
    (tmp_path / "train.py").write_text("import hpc_ddp\n")
    (tmp_path / "check" / "runs" / "train" / "straight").mkdir(parents=True)
    arguments = [
        "check-resume",
        "--output-dir",
        str(tmp_path / "check"),
        str(tmp_path / "train.py"),
    ]
    assert main(arguments) == 2
    error = capsys.readouterr().err
    assert f"--output-dir {tmp_path / 'check'} holds the runs of an earlier check" in error
    assert "HINT: pass a new folder, or remove that one" in error
    assert (
        main(["check-resume", "--steps", "10", "--stop-at", "10", str(tmp_path / "train.py")]) == 2
    )
    assert "--stop-at 10 is not before the end of the check (--steps 10)" in capsys.readouterr().err
    assert main(["check-resume", "--world-size-change", "2", str(tmp_path / "train.py")]) == 2
    assert "--world-size-change 2 is the --nproc the check starts on" in capsys.readouterr().err
    script = str(tmp_path / "train.py")
    assert main(["check-resume", "--rtol", "0.1", script]) == 2
    assert "--rtol 0.1 without --world-size-change" in capsys.readouterr().err
    assert main(["check-resume", "--world-size-change", "1", "--atol", "-1", script]) == 2
    error = capsys.readouterr().err
    assert "--atol -1.0 is not a tolerance" in error and "HINT: give a number >= 0" in error


def test_torchruns_exit_1_is_a_stop_only_where_this_launch_recorded_it() -> None:
    """torchrun exits 1 for any worker's non-zero exit, the stop's (3) included: the run's
    record tells them apart, and a launch that failed before writing one leaves the earlier
    stop's record, which must not pass for its own."""
    stopped = {"state": "stopped", "global_step": 20, "updated": 1000.0}
    assert stop_code(1, stopped, launched_unix=990.0, at_step=20) == EXIT_STOPPED
    assert stop_code(1, stopped, launched_unix=1010.0, at_step=20) == 1, "an earlier launch's"
    assert stop_code(1, stopped, launched_unix=990.0, at_step=40) == 1, "stopped elsewhere"
    assert stop_code(1, {**stopped, "state": "failed"}, 990.0, 20) == 1
    assert stop_code(1, None, 990.0, 20) == 1
    assert stop_code(0, stopped, 990.0, 20) == 0 and stop_code(2, stopped, 990.0, 20) == 2


def test_the_checks_runs_inherit_no_surrounding_launch() -> None:
    inside_a_job = {
        "SLURM_JOB_ID": "7", "RANK": "3", "MASTER_PORT": "29500", "PET_NNODES": "2",
        "TORCHELASTIC_RESTART_COUNT": "1", "HOME": "/home/a", "PATH": "/bin",
    }  # fmt: skip
    assert check_environment(inside_a_job) == {
        "HOME": "/home/a", "PATH": "/bin", "GLOO_SOCKET_IFNAME": "lo"
    }  # fmt: skip
    assert check_environment({"GLOO_SOCKET_IFNAME": "eth0"}) == {"GLOO_SOCKET_IFNAME": "eth0"}
