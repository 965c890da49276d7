"""What ``hpc-ddp check-resume`` compares: two runs of one script at the same step, one never
stopped and one stopped and resumed, read from their newest checkpoints (every registered
object's tensors and state, the random streams, the data position, the metric sums) and from
the metrics each logged after the stop (:mod:`hpc_ddp.view.resume_verdict` says what a
difference most likely means)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from hpc_ddp.runtime.checkpoint.files import list_checkpoints
from hpc_ddp.runtime.checkpoint.sharded.metadata import read_metadata
from hpc_ddp.runtime.checkpoint.sharded.reading import full_tensors, read_blobs
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.monitor.paces import PACE_METRICS
from hpc_ddp.runtime.monitor.throughput import THROUGHPUT_METRICS
from hpc_ddp.runtime.tracking.record import read_metrics

#: What may differ between two runs that computed the same: times, ids, how they started.
NOT_COMPARED = ("run.train_time_s", "run.mlflow_run_id", "run.restart_count", "run.finished")
#: The metrics hpc_ddp logs that measure the machine's pace, not the training (and every
#: system/ metric: the machines' CPU, memory and GPUs).
TIMED_METRICS = (
    "interval/samples_per_s",
    "interval/steps_per_s",
    "goodput_percent",
    "rank_hours",
    *(f"interval/{name}" for name in (*PACE_METRICS, *THROUGHPUT_METRICS)),
)
#: What a resume on another number of ranks cannot carry over: each rank's own state (its
#: random streams, seeded anew, and what it registered per rank) and the number of ranks.
NOT_COMPARED_ACROSS_SIZES = ("rank.", "run.world_size")


class Tolerance(NamedTuple):
    """How far two floating-point values may be apart and count as equal (torch.isclose's
    rtol and atol): a resume on another number of ranks sums in another order."""

    rtol: float
    atol: float

    def __str__(self) -> str:
        return f"rtol {self.rtol:g}, atol {self.atol:g}"


class Difference(NamedTuple):
    """One saved value that differs: its dotted place and the two values, shortly."""

    key: str
    straight: str
    resumed: str


def _flat(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _flat(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _flat(item, f"{prefix}[{index}]")
    else:
        yield prefix, value


def saved_state(run_dir: Path) -> tuple[int, dict[str, Any]]:
    """The newest checkpoint of ``run_dir``: its step, and everything in it by dotted key
    (``objects.model.weight``, ``run.plain.optimizer.param_groups[0].lr``, ``rank.1.rng``)."""
    folders = list_checkpoints(run_dir / "checkpoints")
    if not folders:
        raise HpcDdpError(
            f"the run in {run_dir} saved no checkpoint, so there is nothing to compare",
            "register what the script trains (run.register(model=..., optimizer=...)) and "
            "leave checkpoint.enabled on",
        )
    folder = folders[0]
    blobs = read_blobs(folder, ["run"])
    world_size = int(blobs["run"]["world_size"])
    blobs.update(read_blobs(folder, [f"rank.{rank}" for rank in range(world_size)]))
    state = dict(_flat(blobs, ""))
    names = {key.split(".")[1] for key in read_metadata(folder).state_dict_metadata
             if key.startswith("objects.")}  # fmt: skip
    for name in sorted(names):
        for key, value in full_tensors(folder, name, with_values=True).items():
            state[f"objects.{name}.{key}"] = value
    return int(blobs["run"]["global_step"]), state


def _close(first: torch.Tensor, second: torch.Tensor, tolerance: Tolerance | None) -> torch.Tensor:
    """Which elements of two tensors of one shape and dtype are equal: within ``tolerance``
    for floating point where one is given, a NaN in both equal."""
    if tolerance is not None and first.is_floating_point():
        return torch.isclose(first.double(), second.double(), *tolerance, equal_nan=True)
    if first.is_floating_point() or first.is_complex():
        return (first == second) | (first.isnan() & second.isnan())
    return first == second


def _same(first: Any, second: Any, tolerance: Tolerance | None = None) -> bool:
    if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
        if not (isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)):
            return False
        if first.shape != second.shape or first.dtype != second.dtype:
            return False
        return bool(_close(first, second, tolerance).all())
    if isinstance(first, float) and isinstance(second, float):
        if first == second or (math.isnan(first) and math.isnan(second)):
            return True
        if tolerance is not None:
            return abs(first - second) <= tolerance.atol + tolerance.rtol * abs(second)
        return False
    return bool(first == second)


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)} sum {value.double().sum().item():.6g}"
    return repr(value)[:60]


def _shown(straight: Any, resumed: Any, tolerance: Tolerance | None = None) -> tuple[str, str]:
    """The two values shortly; two tensors of one shape also by their first element that
    differs (:func:`_close`), written in full: their sums
    may not show it (two random streams' states hold the same numbers, one draw apart)."""
    texts = _short(straight), _short(resumed)
    both = isinstance(straight, torch.Tensor) and isinstance(resumed, torch.Tensor)
    if not both or not straight.dim() or straight.shape != resumed.shape:
        return texts
    if straight.dtype != resumed.dtype or straight.is_complex():
        return texts
    first, second = straight.flatten(), resumed.flatten()
    close = _close(first, second, tolerance)
    if bool(close.all()):
        return texts
    at = int((~close).to(torch.uint8).argmax())
    place = ", ".join(str(int(i)) for i in torch.unravel_index(torch.tensor(at), straight.shape))
    return (
        f"{texts[0]}, [{place}] {first[at].item()!r}",
        f"{texts[1]}, [{place}] {second[at].item()!r}",
    )


def differences(
    straight: Mapping[str, Any], resumed: Mapping[str, Any], tolerance: Tolerance | None = None
) -> list[Difference]:
    """Each compared key whose value differs (or that one run lacks), in the saved order;
    with a ``tolerance`` (a resume on another number of ranks), floating-point values within
    it are equal and what cannot carry over is not compared."""
    skipped = NOT_COMPARED if tolerance is None else NOT_COMPARED + NOT_COMPARED_ACROSS_SIZES
    found = []
    for key in [*straight, *(key for key in resumed if key not in straight)]:
        if key.startswith(skipped):
            continue
        if key not in straight or key not in resumed:
            shown = [_short(run[key]) if key in run else "(none)" for run in (straight, resumed)]
            found.append(Difference(key, *shown))
        elif not _same(straight[key], resumed[key], _tolerance_for(key, tolerance)):
            pair = _shown(straight[key], resumed[key], _tolerance_for(key, tolerance))
            found.append(Difference(key, *pair))
    return found


def optimizer_setting(key: str) -> tuple[str, str, str] | None:
    """(object, group, setting) for ``run.plain.<object>.param_groups[<i>].<setting>`` (an
    optimizer saved as it is) or ``objects.<object>.param_groups.<i>.<setting>`` (one with
    state, saved through DCP)."""
    parts = key.split(".")
    if len(parts) == 5 and parts[:2] == ["run", "plain"] and parts[3].startswith("param_groups["):
        return parts[2], parts[3].removeprefix("param_groups"), parts[4]
    if len(parts) == 5 and parts[0] == "objects" and parts[2] == "param_groups":
        return parts[1], f"[{parts[3]}]", parts[4]
    return None


def _tolerance_for(key: str, tolerance: Tolerance | None) -> Tolerance | None:
    """None (exact) for what another order of summing cannot change: an optimizer's settings
    and the metric counts (a sample lost or seen twice on the new ranks)."""
    if optimizer_setting(key) is not None or key.endswith(".count"):
        return None
    return tolerance


def logged_after(run_dir: Path, step: int) -> dict[tuple[int, str], float | None]:
    """The metrics a run logged from ``step`` on (its own record's points, by the step they
    were logged at), by (step, name); timings left out."""
    points: dict[tuple[int, str], float | None] = {}
    for entry in read_metrics(run_dir):
        at = int(entry.get("step", -1))
        if at < step:
            continue
        for name, value in dict(entry.get("metrics", {})).items():
            if name not in TIMED_METRICS and not name.startswith("system/"):
                points[(at, name)] = value
    return points


def metric_differences(
    straight: Mapping[tuple[int, str], float | None],
    resumed: Mapping[tuple[int, str], float | None],
    tolerance: Tolerance | None = None,
) -> list[tuple[int, str]]:
    """The (step, metric) points logged differently (or by one run only), in step order."""
    return [
        key
        for key in sorted(set(straight) | set(resumed))
        if key not in straight
        or key not in resumed
        or not _same(straight[key], resumed[key], tolerance)
    ]
