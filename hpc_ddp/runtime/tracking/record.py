"""The run's own record in its directory, readable without MLflow or a server.

Rank 0 keeps two small files in ``<output_dir>/<name>/<run id>/``:

- ``status.json``: the state (running, requeued, finished, failed, stopped), the attempt
  count, the step and epoch reached, where the current attempt runs (host, pid, job id),
  replaced atomically at every log interval and at the end;
- ``metrics.jsonl``: one line per logged batch of metrics, ``{"step", "global_step",
  "epoch", "time", "metrics"}``, appended; before an attempt's first one, a line
  ``{"attempt", "from_step", "time"}`` says where the attempt's training state began, and
  readers drop the points earlier attempts logged after that step (a run restarted from an
  earlier checkpoint, or from nothing, supersedes them);
- ``tracking.json`` (when tracking is on): where the run is tracked (MLflow URI, experiment,
  run name, params, tags, the MLflow run's id once known, and ``tags_set``: the tags set
  while it trained, such as ``hpc_ddp.idle_gpus``, kept over its attempts), so that
  ``hpc-ddp tracking sync`` and a run whose MLflow answers again can replay the record.

``hpc-ddp runs`` and ``hpc-ddp plot`` read them with the functions here; rank 0 writes
them (:class:`hpc_ddp.runtime.tracking.journal.JournalTracker`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.arguments import is_number
from hpc_ddp.runtime.safefiles import replace_bytes

STATUS_FILE = "status.json"
METRICS_FILE = "metrics.jsonl"
TRACKING_FILE = "tracking.json"
#: Each attempt's code and environment (:mod:`hpc_ddp.runtime.tracking.provenance`).
PROVENANCE_FILE = "provenance.json"


#: tracking.json's tags set while the run trained.
TAGS_SET = "tags_set"


def tags_set(tracking: Mapping[str, Any]) -> dict[str, str]:
    """The tags a run set while it trained, from its tracking.json (a record edited by hand
    keeps only its string pairs)."""
    found = tracking.get(TAGS_SET)
    if not isinstance(found, dict):
        return {}
    return {k: v for k, v in found.items() if isinstance(k, str) and isinstance(v, str)}


def read_tags_set(run_dir: Path) -> dict[str, str]:
    """The tags the run set while it trained, from its tracking.json ({} for none)."""
    try:
        return tags_set(parsed_object((run_dir / TRACKING_FILE).read_text()))
    except OSError:
        return {}


def parsed_object(text: str | None) -> dict[str, Any]:
    """``text`` as a JSON object; {} for none, a damaged one or another JSON value."""
    try:
        status = json.loads(text) if text else {}
    except ValueError:
        return {}
    return status if isinstance(status, dict) else {}


def read_status(run_dir: Path) -> dict[str, Any] | None:
    """The run's status.json, or None if it has none (or it cannot be read)."""
    try:
        text = (run_dir / STATUS_FILE).read_text()
    except OSError:
        return None
    return parsed_object(text) or None


#: status.json's key for what became of the attempt's tracking: its tracker's status.
TRACKING_OUTCOME = "tracking"


def mlflow_behind(previous_status: Mapping[str, Any] | None) -> bool:
    """Whether the attempts before, by ``previous_status`` (the run's status.json as the
    next attempt finds it), may have left points out of MLflow: the last one ended with
    tracking failed or off, or never said how it ended (killed outright)."""
    if not previous_status:
        return False  # a new run
    outcome = str(previous_status.get(TRACKING_OUTCOME, ""))
    return not outcome.startswith(("ok", "recovered"))


def read_tracked_run_id(run_dir: Path) -> str | None:
    """The MLflow run named in the run's tracking.json (None: none known)."""
    try:
        run_id = json.loads((run_dir / TRACKING_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return run_id if isinstance(run_id, str) and run_id else None


def read_metrics(run_dir: Path) -> Iterator[dict[str, Any]]:
    """The run's metrics.jsonl in order, the points a later attempt superseded left out; a
    torn last line (a killed writer) is skipped."""
    try:
        lines = (run_dir / METRICS_FILE).read_text().splitlines()
    except OSError:
        return
    yield from current_points(lines)


def read_earlier_metrics(run_dir: Path, began_unix: float, from_step: int) -> list[dict[str, Any]]:
    """What the run's final history holds of the attempts before one that began at
    ``began_unix`` from ``from_step``: their points after ``from_step`` are left out, as that
    attempt's start line drops them, and so is every point the attempt logged itself."""
    try:
        lines = (run_dir / METRICS_FILE).read_text().splitlines()
    except OSError:
        return []
    return current_points([*lines, json.dumps({"from_step": from_step})], began_unix)


def last_logged(
    run_dir: Path, since_unix: float, before_unix: float, tail_bytes: int = 65536
) -> tuple[float, int] | None:
    """The time and global step of the newest interval logged from ``since_unix`` to before
    ``before_unix`` (an attempt's last sign of life, before the next attempt began), if that
    is the newest logged before ``before_unix``; None without one. Reads the file from its
    end, a window at a time: a long run's record is not read whole."""
    try:
        with (run_dir / METRICS_FILE).open("rb") as file:
            size = file.seek(0, os.SEEK_END)
            while True:
                start = max(0, size - tail_bytes)
                file.seek(start)
                lines = file.read(size - start).decode(errors="replace").splitlines()
                whole = lines if start == 0 else lines[1:]  # the first may be cut
                found = _newest_interval(whole, before_unix)
                if found is not None or start == 0:
                    break
                tail_bytes *= 2
    except OSError:
        return None
    return found if found is not None and found[0] >= since_unix else None


def _newest_interval(lines: list[str], before_unix: float) -> tuple[float, int] | None:
    for line in reversed(lines):
        entry = parsed_object(line)
        logged, step = entry.get("time"), entry.get("global_step")
        if isinstance(logged, int | float) and isinstance(step, int) and logged < before_unix:
            return float(logged), step
    return None


def current_points(lines: Iterable[str], logged_before: float = math.inf) -> list[dict[str, Any]]:
    """The metric entries of ``lines`` that the run's final history holds: at an attempt's
    start line, the earlier attempts' points after its ``from_step`` are dropped, and at
    ``from_step`` itself a metric the new attempt logs again replaces the old value. Lines
    timed at ``logged_before`` (Unix s) or later are left out."""
    kept: list[dict[str, Any]] = []
    earlier = 0  # kept[:earlier] are the earlier attempts' points
    restart: int | None = None  # the current attempt's from_step
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        if is_number(entry.get("time")) and entry["time"] >= logged_before:
            continue
        if isinstance(entry.get("metrics"), dict):
            entry = _whole_entry(entry)
            if entry is None:
                continue
            if restart is not None and entry.get("step") == restart:
                for old in kept[:earlier]:
                    if old.get("step") == restart:
                        old["metrics"] = {
                            name: value
                            for name, value in old["metrics"].items()
                            if name not in entry["metrics"]
                        }
            kept.append(entry)
        elif isinstance(entry.get("from_step"), int):
            restart = entry["from_step"]
            kept = [old for old in kept if not _step_after(old, restart)]
            earlier = len(kept)
    return [entry for entry in kept if entry["metrics"]]


def _whole_entry(entry: dict[str, Any]) -> dict[str, Any] | None:
    """A metric entry as readers need it (whole-number steps, time and epoch; each value a
    number or None), or None for a damaged one; a damaged value alone is left out."""
    steps = [entry.get(key, 0) for key in ("step", "global_step", "epoch")]
    if not all(isinstance(step, int) and not isinstance(step, bool) for step in steps):
        return None
    if not is_number(entry.get("time", 0.0)):
        return None
    metrics = {
        name: value
        for name, value in entry["metrics"].items()
        if isinstance(name, str) and (value is None or is_number(value))
    }
    return {**entry, "metrics": metrics}


def _step_after(entry: Mapping[str, Any], step: int) -> bool:
    value = entry.get("step")
    return isinstance(value, int | float) and value > step


def replace_json(path: Path, data: Any) -> None:
    """Write a small JSON file so that readers see the old one or the new one, never half."""
    replace_bytes(path, (json.dumps(data, sort_keys=True, default=str) + "\n").encode())


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
