"""Per-iteration time of the demo workload: reference executor vs the Ray runtime on 1 and 2 devices.

    .venv/bin/python benchmarks/runtime_overhead.py [--iterations 8] [--prompts 64]

A short SFT warm start gives the policy realistic, varied response lengths; then each executor runs the
demo's PPO workload (actor, ref, critic, reward model + rule) for the same iterations from the same seed.
The first iteration of each run (worker warm-up) is excluded; the table gives the median of the rest, the
ratio to the reference, and the controller's own share of the iteration (time not spent waiting for
workers). All runs happen side by side in this one process, so they share the machine's conditions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rich.console import Console  # noqa: E402

from demo_workload import prepare, run_ppo  # noqa: E402
from loomrl.report import summary_table  # noqa: E402
from loomrl.runtime.launch import quiet_libraries  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=64)
    args = ap.parse_args()
    quiet_libraries()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        prepare(tmp)
        setups = {
            "reference (1 process)": ("runtime.executor=reference", "runtime.threads=2"),
            "ray, 1 device": ("runtime.executor=ray", "runtime.devices=1", "runtime.threads=2"),
            "ray, 2 devices (dp=2)": ("runtime.executor=ray", "runtime.devices=2", "runtime.threads=1"),
        }
        results = {
            name: run_ppo(tmp, str(i), args.iterations, args.prompts, *extra)
            for i, (name, extra) in enumerate(setups.items())
        }
    base = statistics.median(m["time/iteration_s"] for m in results["reference (1 process)"][1:])
    rows = []
    for name, metrics in results.items():
        it = statistics.median(m["time/iteration_s"] for m in metrics[1:])
        ctrl = statistics.median(m.get("time/controller_s", 0.0) for m in metrics[1:])
        rows.append(
            {
                "executor": name,
                "s/iteration": it,
                "vs reference": it / base,
                "controller s": ctrl,
                "controller share": ctrl / it,
            }
        )
    Console().print(
        summary_table(rows, f"PPO demo workload, {args.prompts} prompts, median of {args.iterations - 1} iterations")
    )


if __name__ == "__main__":
    main()
