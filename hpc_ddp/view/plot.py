"""`hpc-ddp plot RUN`: a PNG of a run's training and validation curves (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.tracking.record import read_metrics
from hpc_ddp.view.attempt_marks import mark_attempts, resume_steps
from hpc_ddp.view.machines import draw_usage, usage_series
from hpc_ddp.view.runs import HELD_OUT, RunView, metric_kind
from hpc_ddp.view.steptime import draw_step_time, step_time_series

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
            elif kind == "val":
                label, step = name, entry["global_step"]
            else:
                label, step = f"{name} (epoch)", entry["global_step"]
            steps, values = (val if kind == "val" else train).setdefault(label, ([], []))
            steps.append(float(step))
            values.append(float(value))
    return train, val


def figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise HpcDdpError(
            "hpc-ddp plot needs matplotlib, which is not installed",
            'pip install matplotlib (or pip install "hpc_ddp[plot]")',
        ) from None
    return Figure


#: Name parts of a metric that grows as the model improves (drawn on a linear axis of its
#: own); every other metric is a loss or an error (drawn on a log axis).
SCORE_WORDS = ("acc", "precision", "recall", "f1", "auc", "top", "score", "iou", "bleu")


def is_score(label: str) -> bool:
    return any(word in label.lower() for word in SCORE_WORDS)


def base_name(label: str) -> str:
    """The metric a series belongs to, the same for its interval, epoch and validation
    series: ``val_loss``, ``train_loss (epoch)`` and ``loss`` are all ``loss``."""
    name = label.removesuffix(" (epoch)")
    for split in (*HELD_OUT, "train"):
        for separator in ("_", "/"):
            name = name.removeprefix(split + separator)
    return name


def plot_run(run: RunView) -> Any:
    """A matplotlib Figure: a panel of losses (log axis) and one of scores such as accuracy,
    each metric in one colour for its interval (thin line), epoch (dots) and validation
    (squares, dashed) series; where the run recorded its machines, a panel of each GPU's
    utilisation (or each host's CPU); a dotted line where each attempt after the first
    resumed; where the run recorded where its time went, a panel of those parts stacked.
    A script that logs no metric of its own still gets its machines and step-time panels."""
    train, val = curves(run.path)
    usage_title, usage = usage_series(run.path)
    time_steps, time_parts = step_time_series(run.path)
    resumes = resume_steps(run.path)  # read once: every panel marks them
    if not train and not val and not usage and not time_parts:
        raise HpcDdpError(
            f"run {run.name}/{run.run_id} has no metrics yet ({run.path})",
            "plot it after its first log interval; run.log(...) adds training metrics",
        )
    every = [(label, data, "train") for label, data in train.items()]
    every += [(label, data, "val") for label, data in val.items()]
    families = [
        (title, [series for series in every if is_score(series[0]) == score])
        for title, score in (("losses", False), ("scores", True))
    ]
    families = [(title, members) for title, members in families if members]
    panels = len(families) + (1 if usage else 0) + (1 if time_parts else 0)
    columns = panels if panels < 4 else 2  # four panels in a row would be too thin to read
    rows = -(-panels // columns)
    names = sorted({base_name(label) for label, _data, _kind in every})
    palette = [f"C{index % 10}" for index in range(len(names))]
    colour = dict(zip(names, palette, strict=True))
    figure = figure_class()(figsize=(5.5 * max(2, columns), 4.2 * rows), layout="constrained")
    for index, (title, members) in enumerate(families, start=1):
        axes = figure.add_subplot(rows, columns, index)
        for label, (steps, values), kind in members:
            style = {"color": colour[base_name(label)], "label": label}
            if kind == "val":
                axes.plot(steps, values, "s--", markersize=4, linewidth=1, zorder=3, **style)
            elif label.endswith("(epoch)"):
                axes.plot(steps, values, "o", markersize=5, zorder=3, **style)
            else:
                axes.plot(
                    steps, values, ".-", markersize=3, linewidth=1, alpha=0.6, zorder=2, **style
                )
        if title == "losses" and all(
            value > 0 for _label, (_steps, values), _kind in members for value in values
        ):
            axes.set_yscale("log")
        mark_attempts(axes, resumes)
        axes.set_title(title)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3, which="both")
        axes.legend(fontsize="small")
    if usage:
        axes = figure.add_subplot(rows, columns, len(families) + 1)
        draw_usage(axes, usage_title, usage, [step for _, step in resumes])
        mark_attempts(axes, resumes)
    if time_parts:
        axes = figure.add_subplot(rows, columns, panels)
        draw_step_time(axes, time_steps, time_parts, [step for _, step in resumes])
        mark_attempts(axes, resumes)
    figure.suptitle(
        f"{run.name}/{run.run_id}: {run.state}, step {run.global_step}, "
        f"{run.attempts} attempt{'s' if run.attempts != 1 else ''}"
    )
    return figure


def save_plot(run: RunView, output: Path | None = None) -> Path:
    """Write the run's curves as a PNG (default ``<run dir>/curves.png``); returns its path."""
    return write_figure(plot_run(run), output or run.path / "curves.png")


def write_figure(figure: Any, path: Path) -> Path:
    """Save ``figure`` to ``path`` in the format its extension names; returns the path."""
    kinds = figure.canvas.get_supported_filetypes()
    if path.is_dir() or path.suffix.lower().lstrip(".") not in kinds:
        seen = "a directory" if path.is_dir() else f"extension {path.suffix!r}"
        seen = seen if path.suffix or path.is_dir() else "no extension"
        raise HpcDdpError(
            f"-o {path}: {seen}, expected a file name ending in one of "
            f"{', '.join('.' + kind for kind in sorted(kinds))}",
            "e.g. -o curves.png (or .pdf, .svg)",
        )
    try:
        figure.savefig(path, dpi=100)
    except OSError as error:
        raise HpcDdpError(
            f"cannot write {path}: {error.strerror or error}",
            "pass -o with a file in a directory that exists and is writable",
        ) from None
    return path
