"""`hpc-ddp plot RUN`: a PNG of a run's training and validation curves (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.tracking.journal import read_metrics
from hpc_ddp.view.runs import RunView, metric_kind

Series = dict[str, tuple[list[float], list[float]]]


def curves(run_dir: Path) -> tuple[Series, Series]:
    """(training, validation) curves: label -> (steps, values). Interval metrics sit at the
    step they cover; epoch and validation metrics at the global step they were logged at."""
    train: Series = {}
    val: Series = {}
    for entry in read_metrics(run_dir):
        for name, value in entry["metrics"].items():
            kind = metric_kind(name)
            if kind is None or value is None:
                continue
            if name.startswith("interval/"):
                label, step = name.removeprefix("interval/"), entry["step"]
            else:
                label, step = f"{name} (epoch)", entry["global_step"]
            steps, values = (val if kind == "val" else train).setdefault(label, ([], []))
            steps.append(float(step))
            values.append(float(value))
    return train, val


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise HpcDdpError(
            "hpc-ddp plot needs matplotlib, which is not installed",
            'pip install matplotlib (or pip install "hpc_ddp[plot]")',
        ) from None
    return Figure


def plot_run(run: RunView) -> Any:
    """A matplotlib Figure: training curves on the left, validation on the right."""
    train, val = curves(run.path)
    if not train and not val:
        raise HpcDdpError(
            f"run {run.name}/{run.run_id} has no metrics yet ({run.path})",
            "plot it after its first log interval; run.log(...) adds training metrics",
        )
    figure = _figure_class()(figsize=(11, 4.2), layout="constrained")
    panels = [("training", train), ("validation", val)] if val else [("training", train)]
    for index, (title, series) in enumerate(panels, start=1):
        axes = figure.add_subplot(1, len(panels), index)
        for label, (steps, values) in series.items():
            style = "o-" if label.endswith("(epoch)") or title == "validation" else "-"
            axes.plot(steps, values, style, label=label, markersize=4, linewidth=1.2)
        axes.set_title(title)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.suptitle(
        f"{run.name}/{run.run_id}: {run.state}, step {run.global_step}, "
        f"{run.attempts} attempt{'s' if run.attempts != 1 else ''}"
    )
    return figure


def save_plot(run: RunView, output: Path | None = None) -> Path:
    """Write the run's curves as a PNG (default ``<run dir>/curves.png``); returns its path."""
    figure = plot_run(run)
    path = output or run.path / "curves.png"
    try:
        figure.savefig(path, dpi=100)
    except OSError as error:
        raise HpcDdpError(
            f"cannot write {path}: {error.strerror or error}",
            "pass -o with a file in a directory that exists and is writable",
        ) from None
    return path
