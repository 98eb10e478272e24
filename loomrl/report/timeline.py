"""Gantt charts of schedules: a PNG (matplotlib, Agg canvas) and a self-contained HTML/SVG page.

One row per device, one bar per :class:`~loomrl.planner.simulation.simulator.Interval` (a schedule step on a device).
Calls are coloured by MFC name (the same colour in every iteration), the steps that move models (copies,
syncs, frees, reloads, offloads) are grey and hatched. Several timelines (a prediction above a measured run)
are drawn one above the other on one time axis, with one colour per step id across them. The HTML page needs
nothing from the network: inline SVG, one ``<rect class="interval">`` per interval with a ``<title>``
tooltip giving the step, kind, iteration and times. A panel may carry marks: a vertical line at an instant with
a short label and a tooltip (dynamic placement's decisions, at the end of the iteration each followed).
"""

from __future__ import annotations

import html
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from loomrl.planner.simulation.simulator import Interval, SimResult, format_bytes

__all__ = [
    "TIMELINE_CSS",
    "Mark",
    "interval_colors",
    "render_html",
    "render_timeline",
    "render_timelines",
    "timeline_fragment",
]

_REALLOC_KINDS = ("copy", "sync", "free", "reload", "offload")
_REALLOC_COLOR = "#9e9e9e"


def interval_colors(timeline: list[Interval]) -> dict[str, str]:
    """Label → hex colour: calls in order of first appearance on the tab20 palette, the steps that move models
    (copies, syncs, frees, reloads, offloads) grey."""
    palette = colormaps["tab20"]
    colors: dict[str, str] = {}
    calls = 0
    for iv in timeline:
        if iv.label in colors:
            continue
        if iv.kind in _REALLOC_KINDS:
            colors[iv.label] = _REALLOC_COLOR
        else:
            colors[iv.label] = to_hex(palette(calls % palette.N))
            calls += 1
    return colors


def _summary(result: SimResult) -> str:
    text = f"iteration {result.iteration_time:.4g} s"
    if result.peak_memory:
        text += f", peak memory {format_bytes(max(result.peak_memory.values()))}"
    return text + ("" if result.feasible else f"; INFEASIBLE: {result.reason}")


def _devices(result: SimResult) -> list[int]:
    return sorted({iv.device for iv in result.timeline} | set(result.busy_fraction))


Panel = tuple[str, SimResult]
"""A timeline to draw and its title."""


class Mark(NamedTuple):
    """An instant of a panel worth a line: ``label`` beside it, ``detail`` in its tooltip."""

    at: float
    label: str
    detail: str = ""
    strong: bool = False
    """Drawn solid and red (e.g. a plan switch) rather than dotted grey."""


Marks = Mapping[str, Sequence[Mark]]
"""Marks by the title of the panel they belong to."""


def render_png(
    panels: list[Panel], png_path: str | os.PathLike[str], title: str = "", marks: Marks | None = None
) -> Path:
    """Draw each panel's Gantt chart, one above the other on one time axis, into ``png_path``."""
    colors = interval_colors([iv for _, result in panels for iv in result.timeline])
    heights = [1.2 + 0.45 * max(len(_devices(result)), 1) for _, result in panels]
    fig = Figure(figsize=(10.0, 0.4 + sum(heights)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False, height_ratios=heights)[:, 0]
    span = max((result.makespan or 0.0) for _, result in panels) or 1.0
    for ax, (name, result) in zip(axes, panels):
        devices = _devices(result)
        for iv in result.timeline:
            moves = iv.kind in _REALLOC_KINDS
            ax.barh(
                iv.device,
                max(iv.end - iv.start, span * 1e-4),
                left=iv.start,
                height=0.8,
                color=colors[iv.label],
                edgecolor="black",
                linewidth=0.3,
                hatch="//" if moves else None,
            )
            if iv.end - iv.start > span * 0.06:
                ax.text(
                    (iv.start + iv.end) / 2, iv.device, iv.label, ha="center", va="center", fontsize=6, clip_on=True
                )
        ax.set_yticks(devices, [f"device {d}" for d in devices])
        ax.set_ylim(max(devices, default=0) + 0.6, min(devices, default=0) - 0.6)  # device 0 on top
        ax.set_xlim(0, span)
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(f"{name + ': ' if name else ''}{_summary(result)}", fontsize=8)
        for mark in (marks or {}).get(name, ()):
            ax.axvline(
                mark.at, color="red" if mark.strong else "#555", linestyle="-" if mark.strong else ":", linewidth=1.0
            )
            ax.text(
                mark.at,
                min(devices, default=0) - 0.5,
                f" {mark.label}",
                fontsize=6,
                va="top",
                color="red" if mark.strong else "#333",
                clip_on=True,
            )
    axes[-1].set_xlabel("seconds")
    handles = [Patch(facecolor=c, edgecolor="black", label=label) for label, c in colors.items()]
    if handles:
        axes[0].legend(handles=handles, fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if title:
        fig.suptitle(title, fontsize=9)
    out = Path(png_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def _svg(
    result: SimResult,
    colors: dict[str, str],
    span: float,
    marks: Sequence[Mark] = (),
    width: int = 1000,
    row: int = 26,
    left: int = 80,
) -> str:
    devices = _devices(result)
    scale = (width - left - 10) / span
    height = row * len(devices) + 30
    y = {d: 5 + row * k for k, d in enumerate(devices)}
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" width="{width}" height="{height}" font-size="11">'
    ]
    for d in devices:
        parts.append(f'<text x="4" y="{y[d] + row / 2 + 4:.1f}">device {d}</text>')
    for k in range(11):  # time axis: ten equal ticks
        x = left + k * (width - left - 10) / 10
        parts.append(f'<line x1="{x:.1f}" y1="0" x2="{x:.1f}" y2="{height - 20}" stroke="#ddd"/>')
        parts.append(f'<text x="{x:.1f}" y="{height - 6}" text-anchor="middle">{span * k / 10:.3g}</text>')
    for iv in result.timeline:
        x, w = left + iv.start * scale, max((iv.end - iv.start) * scale, 0.5)
        tip = html.escape(f"{iv.label} ({iv.kind}), iteration {iv.iteration}: {iv.start:.4g}-{iv.end:.4g} s")
        parts.append(
            f'<rect class="interval" x="{x:.2f}" y="{y[iv.device] + 2}" width="{w:.2f}" '
            f'height="{row - 4}" fill="{colors[iv.label]}" stroke="#333" stroke-width="0.4">'
            f"<title>{tip}</title></rect>"
        )
    for mark in marks:
        x, color = left + mark.at * scale, "red" if mark.strong else "#555"
        dash = "" if mark.strong else ' stroke-dasharray="2,2"'
        parts.append(
            f'<g class="mark"><title>{html.escape(mark.detail or mark.label)}</title>'
            f'<line x1="{x:.1f}" y1="0" x2="{x:.1f}" y2="{height - 20}" stroke="{color}"{dash}/>'
            f'<text x="{x + 2:.1f}" y="10" fill="{color}">{html.escape(mark.label)}</text></g>'
        )
    parts.append("</svg>")
    return "\n".join(parts)


TIMELINE_CSS = (
    ".key{margin-right:1em;white-space:nowrap} "
    ".swatch{display:inline-block;width:1em;height:1em;margin-right:.3em;vertical-align:middle} "
    "td,th{padding:0 .8em;text-align:right}"
)
"""The styles :func:`timeline_fragment` needs in the page that holds it."""


def timeline_fragment(panels: list[Panel], marks: Marks | None = None) -> str:
    """HTML of each panel's Gantt chart (inline SVG, one time axis for all), its per-device figures and the
    legend, for a page that includes :data:`TIMELINE_CSS` (this page's, or the run report's)."""
    colors = interval_colors([iv for _, result in panels for iv in result.timeline])
    span = max((result.makespan or 0.0) for _, result in panels) or 1.0
    legend = "".join(
        f'<span class="key"><span class="swatch" style="background:{c}"></span>{html.escape(label)}</span>'
        for label, c in colors.items()
    )
    body = []
    for name, result in panels:
        rows = "".join(
            f"<tr><td>{d}</td><td>{result.busy_fraction.get(d, 0.0):.1%}</td>"
            f"<td>{format_bytes(result.peak_memory.get(d, 0.0))}</td></tr>"
            for d in _devices(result)
        )
        body.append(
            f"<h3>{html.escape(name)}</h3>\n<p>{html.escape(_summary(result))}</p>\n"
            f"{_svg(result, colors, span, (marks or {}).get(name, ()))}\n"
            f"<table><tr><th>device</th><th>busy</th><th>peak memory</th></tr>{rows}</table>"
        )
    return "\n".join(body) + f"\n<p>{legend}</p>"


def render_html(panels: SimResult | list[Panel], title: str = "", marks: Marks | None = None) -> str:
    """A self-contained HTML page with each panel's Gantt chart as inline SVG on one time axis, a legend and
    the per-device figures."""
    if isinstance(panels, SimResult):
        panels = [("", panels)]
    heading = html.escape(title or "simulated schedule")
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{heading}</title>\n<style>'
        f"body{{font-family:sans-serif;margin:1em}} {TIMELINE_CSS}</style></head><body>\n"
        f"<h2>{heading}</h2>\n" + timeline_fragment(panels, marks) + "\n</body></html>\n"
    )


def render_timelines(
    panels: list[Panel],
    png_path: str | os.PathLike[str],
    html_path: str | os.PathLike[str] | None = None,
    title: str = "",
    marks: Marks | None = None,
) -> None:
    """Write the panels' Gantt charts, one above the other, to ``png_path`` and, if given, ``html_path``."""
    render_png(panels, png_path, title, marks)
    if html_path is not None:
        out = Path(html_path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(render_html(panels, title, marks), encoding="utf-8")


def render_timeline(
    result: SimResult,
    png_path: str | os.PathLike[str],
    html_path: str | os.PathLike[str] | None = None,
    title: str = "",
) -> None:
    """Write the Gantt chart of ``result`` to ``png_path`` and, if given, the HTML page to ``html_path``."""
    render_timelines([(title, result)], png_path, html_path)
