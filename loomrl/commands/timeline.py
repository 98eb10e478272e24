"""`loomrl timeline` and `loomrl report`: a run drawn step by step below the simulator's prediction of it, and the
run's HTML report written again from its directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from loomrl.run_dir import RunDir

__all__ = ["run_report_command", "run_timeline_command"]


def run_timeline_command(args: argparse.Namespace) -> int:
    from loomrl.plan.hardware import PROFILES, load_profile
    from loomrl.planner.calibration.local import usable_cores
    from loomrl.planner.cost.corrections import Corrections
    from loomrl.report.run_timeline import placement_marks, predicted_run, read_traces, result_from_traces
    from loomrl.report.timeline import render_timelines

    traces = read_traces(args.run_dir)
    measured = result_from_traces(traces, last_iterations=args.iterations or None)
    panels = [(f"measured ({len(measured.iteration_ends)} iterations)", measured)]
    marks = {panels[0][0]: placement_marks(args.run_dir, traces, args.iterations or None)}  # dynamic placement's
    if not args.measured_only:
        profile = load_profile(args.profile) if args.profile else PROFILES["local"]
        corrections = Corrections.load(args.corrections) if args.corrections else None
        predicted = predicted_run(
            args.run_dir,
            profile,
            corrections,
            cores=usable_cores() if args.profile else None,
            iterations=max(2, len(measured.iteration_ends)),
        )
        source = f"profile {profile.name}" + (", fitted corrections" if corrections else ", uncorrected")
        panels.insert(0, (f"predicted ({source})", predicted))
    out = Path(args.run_dir)
    drawing = RunDir(out).timeline
    render_timelines(
        panels,
        drawing,
        drawing.with_suffix(".html"),
        title=f"{out.name}: each schedule step "
        "per device" + (", the simulator's prediction above the measured run" if len(panels) > 1 else ""),
        marks=marks,
    )
    for name, result in panels:
        print(f"{name}: {result.iteration_time:.3g} s/iteration")
    print(f"wrote {drawing} and {drawing.with_suffix('.html')}")
    if args.chrome:
        from loomrl.report.chrome_trace import write_chrome_trace

        predicted = panels[0][1] if len(panels) > 1 else None
        path = write_chrome_trace(RunDir(out).chrome_trace, traces, predicted, title=out.name)
        print(f"wrote {path} (open it in https://ui.perfetto.dev or chrome://tracing)")
    return 0


def run_report_command(args: argparse.Namespace) -> int:
    from loomrl.report.html import write_run_report

    print(f"wrote {write_run_report(args.run_dir)}")
    return 0
