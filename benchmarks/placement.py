"""Iteration time of the demo workload under each placement strategy on 2 devices.

    .venv/bin/python benchmarks/placement.py [--iterations 6] [--prompts 64] [--devices 2] [--precision fp32]

A short SFT warm start and a small reward model, then the demo's PPO workload for the same iterations from the
same seed under colocate, interleave and separate plans and colocate with FSDP training (and the reference
executor for scale). The first iteration (warm-up) is excluded; the table gives the median seconds per
iteration, the ratio to colocate, the time spent in reallocation-dependent calls and the controller's share.
All runs share this process and machine, side by side.
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


def _colocated_fsdp(devices: int) -> str:
    """Every call on all devices, pure dp, with actor and critic trained under FSDP (their other calls on
    whole copies reallocated from the shards)."""
    every = f"0-{devices - 1}:dp{devices}"
    return (
        f"actor_gen={every}; actor_train={every}fsdp; ref_inf={every}; reward_inf={every}; "
        f"critic_inf={every}; critic_train={every}fsdp; advantages=0:dp1"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument(
        "--precision",
        default="auto",
        choices=("auto", "fp32", "bf16"),
        help="runtime.precision of every run (the SFT warm start stays fp32)",
    )
    args = ap.parse_args()
    quiet_libraries()
    precision = f"runtime.precision={args.precision}"
    ray_args = ("runtime.executor=ray", f"runtime.devices={args.devices}", "runtime.threads=1", precision)
    setups = {
        "reference (1 process, 2 threads)": (None, ("runtime.executor=reference", "runtime.threads=2", precision)),
        "colocate": ("colocate", ray_args),
        "interleave": ("interleave", ray_args),
        "separate": ("separate", ray_args),
        "colocate, FSDP training": (_colocated_fsdp(args.devices), ray_args),
    }
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        prepare(tmp)
        results = {
            name: run_ppo(tmp, str(i), args.iterations, args.prompts, *extra, plan=plan)
            for i, (name, (plan, extra)) in enumerate(setups.items())
        }
    base = statistics.median(m["time/iteration_s"] for m in results["colocate"][1:])
    rows = []
    for name, metrics in results.items():
        it = statistics.median(m["time/iteration_s"] for m in metrics[1:])
        gen = statistics.median(m["time/actor_gen_s"] for m in metrics[1:])
        train = statistics.median(m["time/actor_train_s"] for m in metrics[1:])
        ctrl = statistics.median(m.get("time/controller_s", 0.0) for m in metrics[1:])
        rows.append(
            {
                "placement": name,
                "s/iteration": it,
                "vs colocate": it / base,
                "actor_gen s": gen,
                "actor_train s": train,
                "controller share": ctrl / it,
            }
        )
    Console().print(
        summary_table(
            rows,
            f"PPO demo workload, {args.prompts} prompts, {args.devices} devices, "
            f"precision {args.precision}, median of {args.iterations - 1} iterations",
        )
    )


if __name__ == "__main__":
    main()
