"""The run report: ``RUN_DIR/report.html``, one self-contained page (inline SVG and CSS, nothing fetched) that the
trainer rewrites as the run goes (every ``loop.save_every`` iterations and at the end; ``loomrl report RUN``
writes it for any run).

It holds the learning curves (reward, exact match, KL, response length, the evaluations, seconds per iteration),
the measured per-device timeline of the last iterations and, for runs on CPU devices, the simulator's prediction
of the same run above it, the execution plan as a table, and the config. Everything is read from the run
directory (``metrics.jsonl``, ``traces.jsonl``, ``plan.json``, ``config.yaml``), so a report never needs the
process that made the run. While the run goes, the page reloads itself every minute.
"""

from __future__ import annotations

import html
import json
import os
import time
from pathlib import Path
from typing import Any

from loomrl.errors import LoomError
from loomrl.report.metrics import finite_series
from loomrl.run_dir import RunDir, read_metrics

__all__ = ["curve_svg", "render_report", "write_run_report"]


CURVES = (
    ("reward/mean", "reward (rollouts)"),
    ("reward/exact_match", "exact match (rollouts)"),
    ("kl/mean", "KL to the reference"),
    ("mismatch/mean_abs_logp_diff", "training-inference mismatch (mean |Δ log-prob|)"),
    ("mismatch/ess", "importance weights' effective sample size (mismatch)"),
    ("offpolicy/is_dropped", "dropped by the off-policy correction"),
    ("response/length", "response length (tokens)"),
    ("eval/exact_match", "held-out exact match (greedy)"),
    ("eval/score", "held-out score (greedy)"),
    ("time/iteration_s", "seconds per iteration"),
)
"""Metrics drawn, in order, with their captions; other ``eval/`` metrics a run logs are drawn after them."""

_CSS = (
    "body{font-family:sans-serif;margin:1.2em;color:#222} h1{font-size:1.4em} h2{font-size:1.15em;"
    "margin-top:1.6em;border-bottom:1px solid #ddd} .curves{display:flex;flex-wrap:wrap;gap:12px} "
    ".curve{border:1px solid #ddd;background:#fcfcfc} .note{color:#666} pre{background:#f6f6f6;padding:.8em;"
    "overflow:auto;font-size:12px} table.plan td,table.plan th{padding:2px 10px;text-align:left} "
    "table.plan tr:nth-child(even){background:#f4f4f4}"
)


def _fmt(value: float) -> str:
    return f"{value:.4g}"


FRACTIONS = ("exact_match", "score", "accuracy")
"""Metrics whose name ends so are fractions, drawn on a fixed 0-1 axis so runs compare at a glance."""


def _y_range(key: str, ys: list[float]) -> tuple[float, float]:
    low, high = min(ys), max(ys)
    if key.endswith(FRACTIONS) and 0.0 <= low and high <= 1.0:
        return 0.0, 1.0
    if low == high:  # a flat line sits in the middle
        return low - 0.5 * (abs(low) or 1.0), high + 0.5 * (abs(high) or 1.0)
    return low, high


def curve_svg(key: str, caption: str, xs: list[int], ys: list[float], width: int = 400, height: int = 190) -> str:
    """One metric against iteration as an inline SVG line chart (a dot for a single value)."""
    left, right, top, bottom = 52, 10, 24, 28
    x0, x1 = min(xs), max(xs)
    y0, y1 = _y_range(key, ys)
    sx = (width - left - right) / ((x1 - x0) or 1)
    sy = (height - top - bottom) / (y1 - y0)
    points = [
        (left + (x - x0) * sx if x1 > x0 else (width + left - right) / 2, height - bottom - (y - y0) * sy)
        for x, y in zip(xs, ys)
    ]
    path = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
    marks = "".join(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="2.5"/>' for px, py in points) if len(points) < 40 else ""
    esc = html.escape
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="curve" data-metric="{esc(key)}" data-points="{len(xs)}" '
        f'width="{width}" height="{height}" font-size="11">'
        f'<text x="{left}" y="15" font-weight="bold">{esc(caption)}</text>'
        f'<text x="{width - right}" y="15" text-anchor="end">last {_fmt(ys[-1])}</text>'
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="#999"/>'
        f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="#999"/>'
        f'<text x="{left - 4}" y="{top + 4}" text-anchor="end">{_fmt(y1)}</text>'
        f'<text x="{left - 4}" y="{height - bottom}" text-anchor="end">{_fmt(y0)}</text>'
        f'<text x="{left}" y="{height - 10}">{x0}</text>'
        f'<text x="{width - right}" y="{height - 10}" text-anchor="end">iteration {x1}</text>'
        f'<polyline class="series" fill="none" stroke="#1f77b4" stroke-width="1.6" points="{path}"/>'
        f'<g fill="#1f77b4">{marks}</g></svg>'
    )


def _curves(records: list[dict[str, Any]]) -> str:
    keys = [key for key, _ in CURVES]
    extra = sorted({k for r in records for k in r if k.startswith("eval/") and k not in keys})
    charts = []
    for key, caption in [*CURVES, *((k, k) for k in extra)]:
        xs, ys = finite_series(records, key)
        if xs:
            charts.append(curve_svg(key, caption, xs, ys))
    if not charts:
        return '<p class="note">no iteration logged yet</p>'
    return f'<div class="curves">{"".join(charts)}</div>'


def _plan_table(run_dir: Path) -> str:
    path = RunDir(run_dir).plan
    if not path.is_file():
        return f'<p class="note">no {path.name} in the run directory</p>'
    plan = json.loads(path.read_text(encoding="utf-8"))
    cluster = plan.get("cluster", {})
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{html.escape(str(a['devices']))}</td><td>{a['dp']}</td><td>{a['tp']}</td>"
        f"<td>{a['pp']}</td><td>{a.get('micro_batches', 1)}</td>"
        f"<td>{', '.join(k for k in ('recompute', 'zero', 'fsdp') if a.get(k)) or '-'}</td></tr>"
        for name, a in plan.get("allocations", {}).items()
    )
    head = (
        f"<p>cluster: {cluster.get('nodes')} node(s) × {cluster.get('devices_per_node')} "
        f"{html.escape(str(cluster.get('device_kind')))} device(s)</p>"
    )
    return (
        head + '<table class="plan"><tr><th>model call</th><th>devices</th><th>dp</th><th>tp</th><th>pp</th>'
        f"<th>micro-batches</th><th>options</th></tr>{rows}</table>"
    )


def _timelines(run_dir: Path, predict: bool) -> str:
    """The measured timeline of the last iterations, below the simulator's prediction where one is made."""
    from loomrl.plan.hardware import PROFILES
    from loomrl.report.run_timeline import placement_marks, predicted_run, read_traces, result_from_traces
    from loomrl.report.timeline import timeline_fragment

    try:
        traces = read_traces(run_dir)
        measured = result_from_traces(traces, last_iterations=3)
    except LoomError as err:
        return f'<p class="note">no measured timeline yet ({html.escape(str(err))})</p>'
    panels = [(f"measured (last {len(measured.iteration_ends)} iterations)", measured)]
    marks = {panels[0][0]: placement_marks(run_dir, traces, last_iterations=3)}  # dynamic placement's decisions
    note = ""
    if predict:
        try:
            predicted = predicted_run(run_dir, PROFILES["local"], iterations=max(2, len(measured.iteration_ends)))
            panels.insert(0, ("predicted by the simulator (nominal local profile, uncorrected)", predicted))
        except (LoomError, KeyError, ValueError) as err:
            note = f'<p class="note">no prediction: {html.escape(str(err))}</p>'
    else:
        note = (
            '<p class="note">no prediction: the simulator prices this machine\'s CPU devices only without a '
            "measured profile (loomrl calibrate, then loomrl timeline RUN --profile)</p>"
        )
    return note + timeline_fragment(panels, marks)


def _predictable(run_dir: Path) -> bool:
    """Whether the run ran on CPU devices, which the nominal local profile prices."""
    path = RunDir(run_dir).plan
    if not path.is_file():
        return False
    return json.loads(path.read_text(encoding="utf-8")).get("cluster", {}).get("device_kind") == "cpu"


def render_report(run_dir: str | os.PathLike, running: bool = False, total_iterations: int | None = None) -> str:
    """The HTML of the run report of ``run_dir`` (see the module docstring)."""
    from loomrl.report.timeline import TIMELINE_CSS

    run_dir = Path(run_dir)
    metrics = RunDir(run_dir).metrics
    records = read_metrics(metrics) if metrics.is_file() else []
    done = records[-1]["iteration"] + 1 if records else 0
    status = (
        f"running: {done} of {total_iterations or '?'} iterations" if running else f"finished after {done} iterations"
    )
    config = RunDir(run_dir).config
    config_text = config.read_text(encoding="utf-8") if config.is_file() else "(no config.yaml)"
    name = html.escape(run_dir.resolve().name)
    refresh = '<meta http-equiv="refresh" content="60">' if running else ""
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8">{refresh}<title>{name}: loomrl run report</title>'
        f"<style>{_CSS} {TIMELINE_CSS}</style></head><body>\n"
        f'<h1>{name}</h1>\n<p id="status">{html.escape(status)}; written {time.strftime("%Y-%m-%d %H:%M:%S")}'
        f"</p>\n<h2>Curves</h2>\n{_curves(records)}\n"
        f'<h2>Timeline</h2>\n<div id="timeline">{_timelines(run_dir, _predictable(run_dir))}</div>\n'
        f'<h2>Plan</h2>\n<div id="plan">{_plan_table(run_dir)}</div>\n'
        f'<h2>Config</h2>\n<pre id="config">{html.escape(config_text)}</pre>\n</body></html>\n'
    )


def write_run_report(run_dir: str | os.PathLike, running: bool = False, total_iterations: int | None = None) -> Path:
    """Write ``RUN_DIR/report.html`` atomically (a reader never sees half a page); returns its path."""
    run_dir = Path(run_dir)
    out = RunDir(run_dir).report
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    tmp.write_text(render_report(run_dir, running, total_iterations), encoding="utf-8")
    os.replace(tmp, out)
    return out
