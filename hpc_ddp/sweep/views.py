"""`hpc-ddp sweep status` and `hpc-ddp sweep plot`: a sweep's tasks as its record, their run
directories and Slurm's queue show them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.runtime.configfile import nearest
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.sweep import manifest
from hpc_ddp.sweep.arrays import live_tasks
from hpc_ddp.sweep.spec import describe
from hpc_ddp.view.plot import curves, is_score
from hpc_ddp.view.runs import RunView, load_run


@dataclass(frozen=True)
class TaskRow:
    """One task as `sweep status` shows it."""

    index: int
    #: The record's state, or what Slurm says now: pending, running, requeued (waiting to
    #: start again), finished, failed, stopped, or lost (neither queued nor ended: cancelled,
    #: or killed without a word).
    state: str
    step: int
    attempts: int
    metric: float | None
    settings: str
    job: str | None
    error: str | None


def task_state(
    recorded: str, slurm_state: str | None, queue_known: bool, run_state: str | None = None
) -> str:
    """A task's state from its record and Slurm's queue (None: not queued). An end in the
    record wins: the job script writes it just before its job leaves the queue. A running
    task gone from the queue whose run says it stopped was cancelled (a plain scancel ends
    the job script before it can write the end, after the ranks checkpointed): stopped."""
    if recorded in manifest.ENDED:
        return recorded
    if slurm_state is not None:
        if slurm_state == "PENDING":
            return "requeued" if recorded in ("running", "requeued") else "pending"
        return "running" if slurm_state in ("RUNNING", "COMPLETING") else slurm_state.lower()
    if recorded in ("pending", "running", "requeued") and queue_known:
        return "stopped" if recorded == "running" and run_state == "stopped" else "lost"
    return recorded


def this_attempts_state(run: RunView | None, task: Mapping[str, Any]) -> str | None:
    """The run's state if the run wrote it since the task's record last changed (when its
    attempt started), else None: an earlier attempt's state says nothing of this one."""
    if run is None or run.updated < float(task.get("updated", 0.0)):
        return None
    return run.state


def chosen_metric(data: Mapping[str, Any], runs: list[RunView | None]) -> tuple[str | None, str]:
    """The metric to sort by and its direction: the sweep's, else the first validation
    metric of its runs (max for scores such as accuracy, else min)."""
    name = data.get("metric")
    if name is None:
        found = sorted({key for run in runs if run for key in run.val})
        name = found[0] if found else None
    mode = data.get("mode") or ("max" if name and is_score(name) else "min")
    return name, mode


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def task_rows(
    data: Mapping[str, Any], live: Mapping[str, str] | None
) -> tuple[list[TaskRow], str | None, str]:
    """Every task of the sweep record ``data``, best first by the chosen metric (finished
    tasks first); the metric and its direction. ``live``: Slurm's queue (None: not known)."""
    runs = []
    for task in data["tasks"]:
        try:
            runs.append(load_run(manifest.run_dir_of(data, task)))
        except HpcDdpError:
            runs.append(None)
    metric, mode = chosen_metric(data, runs)
    rows = []
    for task, run in zip(data["tasks"], runs, strict=True):
        newest = {**(run.train if run else {}), **(run.val if run else {})}
        values = task.get("final") or newest
        job = task.get("job")
        rows.append(
            TaskRow(
                index=task["index"],
                state=task_state(
                    task["state"],
                    (live or {}).get(job or ""),
                    live is not None,
                    this_attempts_state(run, task),
                ),
                step=run.global_step if run else int(task.get("step", 0)),
                attempts=int(task["attempts"]),
                metric=_number(values.get(metric)) if metric else None,
                settings=describe(task["settings"]),
                job=job,
                error=task.get("error"),
            )
        )
    sign = -1.0 if mode == "max" else 1.0

    def order(row: TaskRow) -> tuple[int, float, int]:
        done = row.state == "finished" and row.metric is not None
        return (0 if done else 1, sign * row.metric if done and row.metric else 0.0, row.index)

    return sorted(rows, key=order), metric, mode


def format_rows(rows: list[TaskRow], metric: str | None, mode: str) -> str:
    # The value is the run's last, not its best: say so, and which way is better.
    better = "higher" if mode == "max" else "lower"
    heading = f"last {metric} ({better} is better)" if metric else "metric"
    table = [("task", "state", "step", "attempts", heading, "job", "settings")]
    for row in rows:
        value = "-" if row.metric is None else f"{row.metric:.6g}"
        table.append(
            (
                str(row.index),
                row.state,
                str(row.step),
                str(row.attempts),
                value,
                row.job or "-",
                row.settings,
            )
        )
    widths = [max(len(line[column]) for line in table) for column in range(len(table[0]) - 1)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=False))
        + "  "
        + line[-1]
        for line in table
    ]
    lines.append(state_counts(rows))
    lines += [
        f"task {row.index}: {row.error}" for row in rows if row.error and row.state == "failed"
    ]
    return "\n".join(line.rstrip() for line in lines)


def sweep_status(
    sweep_dir: Path, environ: Mapping[str, str]
) -> tuple[dict[str, Any], list[TaskRow], str | None, str, bool]:
    """The record, its tasks (see :func:`task_rows`), the metric and its direction, and
    whether Slurm's queue could be read."""
    data = manifest.read_manifest(sweep_dir)
    live = live_tasks([array["job_id"] for array in data["arrays"]], environ)
    rows, metric, mode = task_rows(data, live)
    return data, rows, metric, mode, live is not None


def state_counts(rows: list[TaskRow]) -> str:
    """``1 failed, 5 finished``."""
    states = sorted({row.state for row in rows})
    return ", ".join(f"{sum(row.state == state for row in rows)} {state}" for state in states)


def plot_sweep(sweep_dir: Path, metric: str | None, output: Path | None) -> Path:
    """One PNG: ``metric`` (default: the chosen one) against the step for every task."""
    from hpc_ddp.view.plot import figure_class

    data = manifest.read_manifest(sweep_dir)
    rows, chosen, _mode = task_rows(data, None)
    metric = metric or chosen
    if metric is None:
        raise HpcDdpError(f"the sweep's runs in {sweep_dir} have no metrics yet", "plot it later")
    figure = figure_class()(figsize=(10, 5), layout="constrained")
    axes = figure.add_subplot(1, 1, 1)
    drawn, logged = 0, set()
    for task in data["tasks"]:
        train, val = curves(manifest.run_dir_of(data, task))
        logged |= set(val) | {name.removesuffix(" (epoch)") for name in train}
        series = val.get(metric) or train.get(metric) or train.get(f"{metric} (epoch)")
        if not series:
            continue
        steps, values = series
        label = f"{task['index']}: {describe(task['settings'])}"
        axes.plot(steps, values, ".-", markersize=4, linewidth=1, label=label[:60])
        drawn += 1
    if not drawn:
        raise HpcDdpError(
            f"no task of sweep {data['name']} has logged {metric!r}"
            + nearest(metric, sorted(logged)),
            f"pass --metric with a metric its runs log: {', '.join(sorted(logged)) or 'none yet'}",
        )
    axes.set_xlabel("step")
    axes.set_ylabel(metric)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    title = f"sweep {data['name']}: {metric}, {drawn} of {len(rows)} tasks"
    axes.set_title(f"{title} ({state_counts(rows)})")
    path = output or sweep_dir / f"{metric.replace('/', '_')}.png"
    try:
        figure.savefig(path, dpi=100)
    except OSError as error:
        raise HpcDdpError(f"cannot write {path}: {error.strerror or error}", "pass -o") from None
    return path
