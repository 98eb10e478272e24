"""A run's timeline in the Chrome trace event format, which Perfetto (ui.perfetto.dev) and ``chrome://tracing``
open, and which ``torch.profiler`` and ``ray timeline`` write.

One complete event (``"ph": "X"``) per schedule step and device, times in microseconds from the run's first
step: the measured run is one process (its devices the threads, every phase included: prologue, iterations,
evaluations, plan changes) and the simulator's prediction, when given, another, so the two line up in one view.
Metadata events name the processes and threads and keep devices in order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loomrl.planner.simulation.simulator import SimResult

__all__ = ["chrome_trace", "write_chrome_trace"]

MEASURED_PID, PREDICTED_PID = 0, 1


def _metadata(pid: int, name: str, devices: list[int]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}},
        {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
    ]
    for device in devices:
        events.append(
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": device, "args": {"name": f"device {device}"}}
        )
        events.append(
            {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": device, "args": {"sort_index": device}}
        )
    return events


def chrome_trace(traces: list[dict], predicted: SimResult | None = None, title: str = "") -> dict[str, Any]:
    """The trace of a run's step records (``traces.jsonl``: step, kind, devices, start[], end[] per device, in
    seconds) and, optionally, of the simulator's prediction of it (times from 0)."""
    if not traces:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    t0 = min(min(t["start"]) for t in traces)
    devices = sorted({d for t in traces for d in t["devices"]})
    events = _metadata(MEASURED_PID, f"measured run{': ' + title if title else ''}", devices)
    for t in traces:
        args = {
            "iteration": t.get("iteration"),
            "phase": t.get("phase", "iteration"),
            "kind": t["kind"],
            "role": t.get("role"),
            "mfc_kind": t.get("mfc_kind"),
        }
        for device, start, end in zip(t["devices"], t["start"], t["end"]):
            events.append(
                {
                    "name": t["step"],
                    "cat": t.get("mfc_kind") or t["kind"],
                    "ph": "X",
                    "pid": MEASURED_PID,
                    "tid": device,
                    "ts": round((start - t0) * 1e6, 3),
                    "dur": round((end - start) * 1e6, 3),
                    "args": args,
                }
            )
    if predicted is not None:
        events += _metadata(PREDICTED_PID, "simulator's prediction", sorted({iv.device for iv in predicted.timeline}))
        for iv in predicted.timeline:
            events.append(
                {
                    "name": iv.label,
                    "cat": iv.kind,
                    "ph": "X",
                    "pid": PREDICTED_PID,
                    "tid": iv.device,
                    "ts": round(iv.start * 1e6, 3),
                    "dur": round((iv.end - iv.start) * 1e6, 3),
                    "args": {"iteration": iv.iteration, "kind": iv.kind},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(
    path: str | Path, traces: list[dict], predicted: SimResult | None = None, title: str = ""
) -> Path:
    """Write :func:`chrome_trace` as JSON to ``path``."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(traces, predicted, title)), encoding="utf-8")
    return path
