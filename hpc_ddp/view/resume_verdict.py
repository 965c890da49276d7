"""What a difference between a run never stopped and one stopped and resumed most likely
means, the likeliest cause first: a warning the runs gave of state a resume gets wrong, an
optimizer setting, the data position, the random streams, other saved state, the logged
metrics."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from hpc_ddp.runtime.checkpoint.unregistered import (
    MODEL_NOT_REGISTERED,
    NOTHING_REGISTERED,
    OPTIMIZER_NOT_REGISTERED,
    STATE_DIFFERS,
)
from hpc_ddp.runtime.loop.data import ITERATED_DIRECTLY
from hpc_ddp.view.resume_check import Difference, optimizer_setting


def _opening(said: str) -> str:
    """How every warning made from ``said`` begins: up to its first placeholder or colon."""
    return said.split("{")[0].split(":")[0]


#: How the runs' warnings of state a resume gets wrong begin; check-resume names them first.
LOSES_WORK = tuple(
    _opening(said)
    for said in (NOTHING_REGISTERED, OPTIMIZER_NOT_REGISTERED, *MODEL_NOT_REGISTERED,
                 STATE_DIFFERS, ITERATED_DIRECTLY)
)  # fmt: skip
#: Of these, state no checkpoint holds: its loss shows in none of their values.
UNSAVED = tuple(_opening(said) for said in MODEL_NOT_REGISTERED)


class Verdict(NamedTuple):
    """The comparison's answer: exact, or what differs, its likely cause and the fix."""

    exact: bool
    what: str
    hint: str


def resume_warnings(logs: Iterable[str]) -> list[str]:
    """The warnings in the runs' ``logs`` (their output, as text) of state a resume gets
    wrong (see :data:`LOSES_WORK`), each once, in the order first given."""
    found: list[str] = []
    for log in logs:
        for line in log.splitlines():
            _, marker, message = line.partition(" WARNING ")
            if marker and message.startswith(LOSES_WORK) and message not in found:
                found.append(message)
    return found


def verdict(
    state_differences: Sequence[Difference],
    metrics_differ: Sequence[tuple[int, str]],
    steps: int,
    stopped_at: int,
    across_sizes: str = "",
    warned: Sequence[str] = (),
) -> Verdict:
    """What the differences most likely mean, the likeliest cause first. ``across_sizes``
    says how a resume on another number of ranks was compared ("" for a bitwise check);
    ``warned``: the runs' warnings of state a resume gets wrong (:func:`resume_warnings`).
    A warning names the cause where the values show only its effects (saved values or
    logged metrics that differ, with no setting, position or stream to blame), and a
    model no checkpoint holds fails the check even where every value agrees; a warning of
    state the values show equal is no difference (an optimizer without state, say)."""
    shown = f"{steps} steps, stopped at {stopped_at}" + (
        f", {across_sizes}" if across_sizes else ""
    )
    by_values, specific = _from_values(state_differences, metrics_differ, shown, across_sizes)
    unsaved = [warning for warning in warned if warning.startswith(UNSAVED)]
    if by_values.exact and unsaved:
        return _warned(unsaved[0], "what the checkpoints hold and the metrics logged agree", shown)
    if by_values.exact or specific or not warned:
        return by_values
    if state_differences:  # a saved state's value first: the metric sums follow it
        first = next(
            (found for found in state_differences if not found.key.startswith("run.metrics.")),
            state_differences[0],
        )
        effect = (f"{len(state_differences)} saved value(s) differ after the resume, the "
                  f"first {first.key}")  # fmt: skip
    else:
        effect = f"the logged metric {metrics_differ[0][1]} differs at step {metrics_differ[0][0]}"
    return _warned(warned[0], effect, shown)


def _warned(warning: str, effect: str, shown: str) -> Verdict:
    said, _, hint = warning.partition(" HINT: ")
    return Verdict(
        False,
        f"the runs warned of state a resume gets wrong: {said.rstrip('.')} ({effect}; {shown})",
        hint or "register it: run.register(...)",
    )


def _from_values(
    state_differences: Sequence[Difference],
    metrics_differ: Sequence[tuple[int, str]],
    shown: str,
    across_sizes: str,
) -> tuple[Verdict, bool]:
    """The verdict from the values alone, and whether it names a cause of its own (a
    setting, the position, the streams) rather than effects whose cause it can only list."""
    if not state_differences and not metrics_differ:
        if across_sizes:
            return Verdict(True, f"resume on another number of ranks holds for this script "
                           f"({shown})", ""), True  # fmt: skip
        return Verdict(True, f"resume is exact for this script ({shown})", ""), True
    keys = [difference.key for difference in state_differences]
    for difference in state_differences:
        setting = optimizer_setting(difference.key)
        if setting is not None and setting[2] != "params":
            name, group, word = setting
            scheduler = "a learning-rate scheduler is not registered" if word in (
                "lr", "initial_lr") else f"what sets {word} is not registered"  # fmt: skip
            return Verdict(
                False,
                f"the optimizer's param_groups{group}['{word}'] differs after the resume "
                f"({difference.straight} never stopped, {difference.resumed} resumed; {shown}): "
                f"{scheduler}",
                f"register it beside the optimizer: run.register(..., {name}={name}, "
                "scheduler=scheduler)",
            ), True
    position = [key for key in keys if key in ("run.global_step", "run.epoch", "run.step_in_epoch")]
    if position and across_sizes:
        return Verdict(
            False,
            f"the data position differs after the resume ({', '.join(position)}; {shown}): "
            "most likely the script's batches are per rank (a DataLoader of its own), so the "
            "global batch and the steps of an epoch change with the number of ranks",
            "run.train_loader(dataset, global_batch_size) keeps the global batch and the "
            "order of the samples on any number of ranks; a loader of your own resumes "
            "exactly on as many ranks as it stopped on",
        ), True
    if position:
        return Verdict(
            False,
            f"the data position differs after the resume ({', '.join(position)}; {shown})",
            "loop with run.steps(...)/run.iterations(...) or run.epochs(...) over run.train_loader"
            ": they resume the position",
        ), True
    streams = [key for key in keys if key.startswith("rank.") and ".rng" in key]
    if streams and len(streams) == len(keys):
        return Verdict(
            False,
            f"only the random streams differ after the resume ({streams[0]}; {shown}): the "
            "script draws random numbers that the resume does not replay",
            "draw them from a generator you register (run.register(gen=generator)) or from "
            "the sample and step",
        ), True
    # The run's metric sums are what the script logged: alone, they are a logged difference.
    states = [found for found in state_differences if not found.key.startswith("run.metrics.")]
    if states and across_sizes:
        first = states[0]
        return Verdict(
            False,
            f"{first.key} differs after the resume beyond the tolerance ({first.straight} never "
            f"stopped, {first.resumed} resumed; {len(states)} saved value(s) differ; {shown})",
            "on another number of ranks each rank computes on other samples: random numbers a "
            "rank draws in training (dropout, noise) and BatchNorm's statistics of its own "
            "batch differ by design, so a script with them cannot agree within a tolerance "
            "(the bitwise check on one number of ranks still proves its resume); without "
            "them, the data order or unregistered state differs, as in the bitwise check",
        ), True
    if states:
        first = next((found for found in states if found.key not in streams), states[0])
        logged = f"; the first logged difference is at step {metrics_differ[0][0]}" if (
            metrics_differ) else ""  # fmt: skip
        also = f", the random streams ({', '.join(streams)}) among them" if streams else ""
        draws = "the script draws random numbers that the resume does not replay, " if (
            streams) else ""  # fmt: skip
        return Verdict(
            False,
            f"{first.key} differs after the resume ({first.straight} never stopped, "
            f"{first.resumed} resumed; {len(states)} saved value(s) differ{also}{logged}; "
            f"{shown}), but no registered setting or position does: {draws}the data order "
            "differs, or state the script keeps is not registered",
            "a DataLoader's order must come from its sampler's seed and epoch "
            "(DistributedSampler with set_epoch) or from a generator you register "
            "(run.train_loader does both); draw random numbers from a generator you "
            "register (run.register(gen=generator)) or from the sample and step; register "
            "every object with a state_dict() that training changes (EMA copy, GradScaler, "
            "second optimizer), keep a value the script changes by hand (a learning rate) in "
            "run.state, and state each rank carries between steps (a recurrent hidden state) "
            "in an object registered with run.register_per_rank",
        ), False
    if metrics_differ:
        step, name = metrics_differ[0]
        where = f"the logged metric {name} differs at step {step} after the resume"
    else:
        where = f"the logged sums of {state_differences[0].key.removeprefix('run.metrics.')} differ"
    return Verdict(
        False,
        f"{where}, but every saved "
        f"state is equal ({shown}): the script keeps an unregistered counter or total",
        "keep it in run.state (run.state['seen'] = ...), or register an object holding it",
    ), False
