"""Rendering a run's metrics for people: PNG curves and small rich tables.

Figures are built on ``matplotlib.figure.Figure`` with the Agg canvas rather than through ``pyplot``, so
plotting needs no display and never changes matplotlib's global backend for the rest of the process.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.markup import escape
from rich.table import Table

from loomrl.report.metrics import finite_series
from loomrl.run_dir import RunDir, read_metrics

# What the trainer logs that says whether learning works, in the order the panels are drawn.
REWARD_CURVE_KEYS = ("reward/mean", "eval/exact_match", "kl/mean", "response/length")


def plot_metrics(
    metrics_path: str | os.PathLike,
    out_png: str | os.PathLike,
    keys: Sequence[str],
    title: str = "",
) -> Path:
    """Plot each of ``keys`` against iteration, one panel per key, into ``out_png``; return its path.

    Keys that the file never logged get no panel; if none was logged the image says so instead of
    failing, since an empty plot of a run that died early is still worth looking at.
    """
    records = read_metrics(metrics_path)
    series = {key: finite_series(records, key) for key in keys}
    present = [key for key in keys if series[key][0]]
    fig = Figure(figsize=(6.0, 2.4 * max(len(present), 1)), layout="constrained")
    FigureCanvasAgg(fig)
    if title:
        fig.suptitle(title)
    if not present:
        ax = fig.add_subplot(1, 1, 1)
        ax.set_axis_off()
        ax.text(0.5, 0.5, f"none of {list(keys)} logged in {Path(metrics_path).name}", ha="center", va="center")
    axes = [fig.add_subplot(len(present), 1, i + 1) for i in range(len(present))]
    for ax, key in zip(axes, present):
        xs, ys = series[key]
        ax.plot(xs, ys, marker="." if len(xs) < 50 else None)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    if axes:
        axes[-1].set_xlabel("iteration")
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def plot_reward_curve(run_dir: str | os.PathLike) -> Path:
    """Plot the reward, eval, KL and length curves of a run to ``RUN_DIR/reward_curve.png``."""
    run_dir = Path(run_dir)
    files = RunDir(run_dir)
    return plot_metrics(files.metrics, files.reward_curve, REWARD_CURVE_KEYS, title=files.path.name)


def summary_table(rows: list[dict[str, Any]], title: str) -> Table:
    """A rich table of ``rows``: columns are the union of keys in first-seen order; floats get 4 digits."""
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    table = Table(title=title)
    for name in columns:
        table.add_column(name, justify="left" if _is_text_column(rows, name) else "right")
    for row in rows:
        table.add_row(*(_format_cell(row.get(name)) for name in columns))
    return table


def _is_text_column(rows: list[dict[str, Any]], name: str) -> bool:
    return any(isinstance(row.get(name), str) for row in rows)


def _format_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return escape(str(value))  # a cell's text as it is: "[none]" is no style tag
