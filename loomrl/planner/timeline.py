"""Gantt charts of a simulated schedule: a PNG (matplotlib, Agg canvas) and a self-contained HTML/SVG page.

One row per device, one bar per :class:`~loomrl.planner.simulator.Interval`. Calls are coloured by MFC name
(the same colour in every iteration), reallocations are grey and hatched. The HTML page needs nothing from
the network: inline SVG, one ``<rect class="interval">`` per interval with a ``<title>`` tooltip giving the
name, kind, iteration and times.
"""

from __future__ import annotations

import html
import os
from pathlib import Path

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from loomrl.planner.simulator import Interval, SimResult, format_bytes

__all__ = ["interval_colors", "render_html", "render_timeline"]

_REALLOC_KINDS = ("copy", "sync")
_REALLOC_COLOR = "#9e9e9e"


def interval_colors(timeline: list[Interval]) -> dict[str, str]:
    """Label → hex colour: calls in order of first appearance on the tab20 palette, reallocations grey."""
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


def render_png(result: SimResult, png_path: str | os.PathLike[str], title: str = "") -> Path:
    """Draw the Gantt chart of ``result`` into ``png_path``; return its path."""
    devices = _devices(result)
    colors = interval_colors(result.timeline)
    fig = Figure(figsize=(10.0, 1.6 + 0.45 * max(len(devices), 1)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    span = result.makespan or 1.0
    for iv in result.timeline:
        realloc = iv.kind in _REALLOC_KINDS
        ax.barh(iv.device, max(iv.end - iv.start, span * 1e-4), left=iv.start, height=0.8,
                color=colors[iv.label], edgecolor="black", linewidth=0.3, hatch="//" if realloc else None)
        if iv.end - iv.start > span * 0.06:
            ax.text((iv.start + iv.end) / 2, iv.device, iv.label, ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(devices, [f"device {d}" for d in devices])
    ax.set_ylim(max(devices, default=0) + 0.6, min(devices, default=0) - 0.6)  # device 0 on top
    ax.set_xlim(0, span)
    ax.set_xlabel("seconds")
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(facecolor=c, edgecolor="black", label=label) for label, c in colors.items()]
    if handles:
        ax.legend(handles=handles, fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"{title + ': ' if title else ''}{_summary(result)}", fontsize=9)
    out = Path(png_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def _svg(result: SimResult, width: int = 1000, row: int = 26, left: int = 80) -> str:
    devices = _devices(result)
    colors = interval_colors(result.timeline)
    span = result.makespan or 1.0
    scale = (width - left - 10) / span
    height = row * len(devices) + 30
    y = {d: 5 + row * k for k, d in enumerate(devices)}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-size="11">']
    for d in devices:
        parts.append(f'<text x="4" y="{y[d] + row / 2 + 4:.1f}">device {d}</text>')
    for k in range(11):  # time axis: ten equal ticks
        x = left + k * (width - left - 10) / 10
        parts.append(f'<line x1="{x:.1f}" y1="0" x2="{x:.1f}" y2="{height - 20}" stroke="#ddd"/>')
        parts.append(f'<text x="{x:.1f}" y="{height - 6}" text-anchor="middle">{span * k / 10:.3g}</text>')
    for iv in result.timeline:
        x, w = left + iv.start * scale, max((iv.end - iv.start) * scale, 0.5)
        tip = html.escape(f"{iv.label} ({iv.kind}), iteration {iv.iteration}: {iv.start:.4g}-{iv.end:.4g} s")
        parts.append(f'<rect class="interval" x="{x:.2f}" y="{y[iv.device] + 2}" width="{w:.2f}" '
                     f'height="{row - 4}" fill="{colors[iv.label]}" stroke="#333" stroke-width="0.4">'
                     f"<title>{tip}</title></rect>")
    parts.append("</svg>")
    return "\n".join(parts)


def render_html(result: SimResult, title: str = "") -> str:
    """A self-contained HTML page with the Gantt chart as inline SVG, a legend and the per-device figures."""
    colors = interval_colors(result.timeline)
    legend = "".join(f'<span class="key"><span class="swatch" style="background:{c}"></span>{html.escape(label)}'
                     "</span>" for label, c in colors.items())
    rows = "".join(f"<tr><td>{d}</td><td>{result.busy_fraction.get(d, 0.0):.1%}</td>"
                   f"<td>{format_bytes(result.peak_memory.get(d, 0.0))}</td></tr>" for d in _devices(result))
    heading = html.escape(title or "simulated schedule")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{heading}</title>\n<style>"
            "body{font-family:sans-serif;margin:1em} .key{margin-right:1em;white-space:nowrap} "
            ".swatch{display:inline-block;width:1em;height:1em;margin-right:.3em;vertical-align:middle} "
            "td,th{padding:0 .8em;text-align:right}</style></head><body>\n"
            f"<h2>{heading}</h2>\n<p>{html.escape(_summary(result))}</p>\n{_svg(result)}\n<p>{legend}</p>\n"
            f"<table><tr><th>device</th><th>busy</th><th>peak memory</th></tr>{rows}</table>\n</body></html>\n")


def render_timeline(result: SimResult, png_path: str | os.PathLike[str],
                    html_path: str | os.PathLike[str] | None = None, title: str = "") -> None:
    """Write the Gantt chart of ``result`` to ``png_path`` and, if given, the HTML page to ``html_path``."""
    render_png(result, png_path, title)
    if html_path is not None:
        out = Path(html_path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(render_html(result, title), encoding="utf-8")
