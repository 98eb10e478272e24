"""Draw a real run the way the simulator draws a plan: from the per-MFC traces the trainer saves.

``RUN_DIR/traces.jsonl`` has one line per MFC call (iteration, MFC, role, kind, start, end, devices); this turns
them into the simulator's timeline so `render_timeline` draws measured and predicted runs alike.
"""

from __future__ import annotations

import json
from pathlib import Path

from loomrl.errors import DataError
from loomrl.planner.simulator import Interval, SimResult


def read_traces(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "traces.jsonl"
    if not path.is_file():
        raise DataError(f"{path}: no traces (runs of `loomrl train` write them)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def result_from_traces(traces: list[dict], last_iterations: int | None = 3) -> SimResult:
    """A measured run as a SimResult (intervals per device, busy fractions, time per iteration), by default
    of its last three iterations so the calls stay readable; peak memory is not measured (left empty)."""
    if last_iterations:
        keep = sorted({t["iteration"] for t in traces})[-last_iterations:]
        traces = [t for t in traces if t["iteration"] in keep]
    if not traces:
        raise DataError("traces: empty")
    t0 = min(t["start"] for t in traces)
    timeline = [Interval(device, t["start"] - t0, t["end"] - t0, t["mfc"], t["kind"], t["iteration"])
                for t in traces for device in t["devices"]]
    timeline.sort(key=lambda i: (i.start, i.device))
    span = max(i.end for i in timeline)
    devices = sorted({i.device for i in timeline})
    busy = {d: sum(i.end - i.start for i in timeline if i.device == d) / span for d in devices}
    ends = []
    for it in sorted({t["iteration"] for t in traces}):
        ends.append(max(t["end"] for t in traces if t["iteration"] == it) - t0)
    per_iteration = (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else ends[0]
    return SimResult(per_iteration, busy, {}, timeline, True, "", ends)
