"""Draw a real run the way the simulator draws a plan: from the per-step traces the trainer saves, next to the
simulator's prediction of the same run.

``RUN_DIR/traces.jsonl`` has one line per executed schedule step (iteration, phase, step id, kind, role, the
devices and each device's start and end; a fused stage's parts too); :func:`result_from_traces` turns an
iteration's steps into the simulator's timeline, and :func:`predicted_run` simulates the run's own plan, models and
workload, so both
carry the same step ids and :func:`loomrl.report.timeline.render_timelines` lines them up. A run under dynamic
placement also wrote ``RUN_DIR/placement.jsonl``; :func:`placement_marks` turns its decisions into marks at the
end of the iterations they followed.
"""

from __future__ import annotations

import json
from pathlib import Path

from loomrl.errors import DataError
from loomrl.plan.hardware import HardwareProfile
from loomrl.planner.cost.corrections import Corrections
from loomrl.planner.simulation.simulator import Interval, SimResult
from loomrl.report.timeline import Mark
from loomrl.run_dir import RunDir

__all__ = ["placement_marks", "predicted_run", "read_traces", "result_from_traces"]

"""Dynamic placement's decisions, one JSON line per check (written by the trainer)."""


def read_traces(run_dir: str | Path) -> list[dict]:
    """Every step trace of a run, in the order written."""
    path = RunDir(run_dir).traces
    if not path.is_file():
        raise DataError(f"{path}: no traces (runs of `loomrl train` write them)")
    traces = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            record = json.loads(line)
            if not {"iteration", "step", "kind", "devices", "start", "end"} <= record.keys():
                raise DataError(f"{path}:{n}: not a step trace (written by an older loomrl?); run again to draw it")
            traces.append(record)
    return traces


def result_from_traces(traces: list[dict], last_iterations: int | None = 3) -> SimResult:
    """A measured run's iterations as a SimResult (intervals per device, busy fractions, time per iteration),
    by default its last three so the steps stay readable; peak memory is not measured (left empty)."""
    traces = _drawn(traces, last_iterations)
    if not traces:
        raise DataError("traces: no iteration steps")
    t0 = min(min(t["start"]) for t in traces)
    timeline = [interval for t in traces for interval in _intervals(t, t0)]
    timeline.sort(key=lambda i: (i.start, i.device))
    span = max(i.end for i in timeline)
    devices = sorted({i.device for i in timeline})
    busy = {d: sum(i.end - i.start for i in timeline if i.device == d) / span for d in devices}
    ends = [
        max(max(t["end"]) for t in traces if t["iteration"] == it) - t0
        for it in sorted({t["iteration"] for t in traces})
    ]
    per_iteration = (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else ends[0]
    return SimResult(per_iteration, busy, {}, timeline, True, "", ends)


def _drawn(traces: list[dict], last_iterations: int | None) -> list[dict]:
    """The iteration steps of the iterations drawn: the last ``last_iterations`` (all when None or 0)."""
    traces = [t for t in traces if t.get("phase", "iteration") == "iteration"]
    if last_iterations:
        keep = sorted({t["iteration"] for t in traces})[-last_iterations:]
        traces = [t for t in traces if t["iteration"] in keep]
    return traces


def placement_marks(run_dir: str | Path, traces: list[dict], last_iterations: int | None = 3) -> list[Mark]:
    """Dynamic placement's decisions about the iterations :func:`result_from_traces` draws, each at the end of
    the iteration it followed (on that timeline's clock): a switch strong, with its gain and cost; none without
    ``RUN_DIR/placement.jsonl``."""
    path = RunDir(run_dir).placement
    drawn = _drawn(traces, last_iterations)
    if not path.is_file() or not drawn:
        return []
    t0 = min(min(t["start"]) for t in drawn)
    ends = {}
    for t in drawn:
        ends[t["iteration"]] = max(ends.get(t["iteration"], 0.0), max(t["end"]) - t0)
    marks = []
    for line in path.read_text(encoding="utf-8").splitlines():
        d = json.loads(line) if line.strip() else None
        if d is None or d.get("iteration") not in ends:
            continue
        figures = f"gain {d['predicted_gain_s']:.3g} s, switch {d['switch_cost_s']:.3g} s"
        label = f"switch ({figures})" if d["switch"] else "stay"
        detail = (
            f"after iteration {d['iteration']}: {'switch to' if d['switch'] else 'stay on'} {d['plan']}; "
            f"{d['reason']}; current {d['current_s']:.3g} s/iteration, best other {d['candidate_s']:.3g} s"
        )
        marks.append(Mark(ends[d["iteration"]], label, detail, bool(d["switch"])))
    return marks


def _intervals(trace: dict, t0: float) -> list[Interval]:
    """A step on each of its devices; a fused stage as its parts (generation, migration, each member call)."""
    if trace.get("parts"):
        kinds = trace.get("part_kinds", {})
        return [
            Interval(int(device), start - t0, end - t0, label, kinds.get(label, "stream_fusion"), trace["iteration"])
            for label, device, start, end in trace["parts"]
        ]
    return [
        Interval(
            device, start - t0, end - t0, trace["step"], trace.get("mfc_kind") or trace["kind"], trace["iteration"]
        )
        for device, start, end in zip(trace["devices"], trace["start"], trace["end"])
    ]


def predicted_run(
    run_dir: str | Path,
    profile: HardwareProfile,
    corrections: Corrections | None = None,
    cores: int | None = None,
    iterations: int = 3,
) -> SimResult:
    """The simulator's prediction of a finished run: its plan, models and measured workload."""
    from loomrl.planner.calibration.runs import load_run, simulate_run

    return simulate_run(load_run(run_dir, profile, cores), corrections, iterations=iterations)
