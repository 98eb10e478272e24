"""`loomrl calibrate`: this machine measured as a hardware profile, or cost-model corrections fitted from runs."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    from loomrl.plan.hardware import PROFILES, load_profile
    from loomrl.planner.calibration.local import calibrate_local, usable_cores

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.runs:
        profile = calibrate_local(args.devices)
        (out / "local_profile.json").write_text(json.dumps(dataclasses.asdict(profile), indent=2))
        print(json.dumps(dataclasses.asdict(profile), indent=2))
        print(f"wrote {out / 'local_profile.json'}")
        return 0
    from loomrl.planner.calibration.runs import fit_from_runs

    saved = out / "local_profile.json"
    measured = saved.is_file()
    profile = load_profile(saved) if measured else PROFILES["local"]
    # the runs were made on this machine: their devices shared its cores (known only for a measured profile)
    corrections = fit_from_runs(args.runs, profile, cores=usable_cores() if measured else None)
    (out / "corrections.json").write_text(corrections.dumps())
    print(corrections.dumps())
    print(f"wrote {out / 'corrections.json'} (profile: {profile.name})")
    return 0
