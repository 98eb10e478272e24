"""The simulator's predicted iteration time against real runs of the demo workload on this machine.

    .venv/bin/python benchmarks/estimator_accuracy.py [--iterations 6] [--prompts 64] [--keep DIR]

Runs the demo's PPO workload for real (Ray runtime, gloo, one torch thread per worker) under calibration plans
and under evaluated plans (strategies × device counts × layouts), all in this one process, side by side. The
machine's profile is measured (``calibrate_local``), the cost model's corrections are fitted from the
calibration runs alone (``fit_from_runs``: per-kind call corrections, then the per-iteration remainder), and
each evaluated plan is then predicted by the simulator from its config and its measured response lengths and
compared with its measured median seconds per iteration (the first iteration excluded). None of the evaluated
runs takes part in the fit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rich.console import Console  # noqa: E402

from demo_workload import prepare, run_ppo  # noqa: E402
from loomrl.planner.calibration.local import calibrate_local, usable_cores  # noqa: E402
from loomrl.planner.calibration.runs import fit_from_runs, load_run, simulate_run  # noqa: E402
from loomrl.report import summary_table  # noqa: E402
from loomrl.runtime.launch import quiet_libraries  # noqa: E402

# name → (devices, plan, extra overrides). Calibration plans differ from every evaluated plan.
CALIBRATION = {
    "cal: one device per call, 2 dev": (
        2,
        "actor_gen=0; ref_inf=1; reward_inf=0; critic_inf=1; actor_train=0; critic_train=1",
        (),
    ),
    "cal: tp2 generation + critic/reward": (
        2,
        "actor_gen=0-1:tp2; ref_inf=0-1; reward_inf=0-1:tp2; critic_inf=0-1:tp2; actor_train=0-1; critic_train=0-1:tp2",
        (),
    ),
    "cal: 4 dev, critic training on 2": (
        4,
        "actor_gen=0-3; ref_inf=0-3; reward_inf=0-3; critic_inf=0-3; actor_train=0-3; critic_train=0-1",
        (),
    ),
    "cal: critic trained under FSDP": (
        2,
        ("actor_gen=0-1; ref_inf=0-1; reward_inf=0-1; critic_inf=0-1; actor_train=0-1; critic_train=0-1:dp2fsdp"),
        (),
    ),
    "cal: critic under FSDP over dp2 x tp2": (
        4,
        ("actor_gen=0-3; ref_inf=0-3; reward_inf=0-3; critic_inf=0-3; actor_train=0-3; critic_train=0-3:dp2tp2fsdp"),
        (),
    ),
}
EVALUATED = {
    "colocate dp2": (2, "colocate", ()),
    "interleave, 2 dev": (2, "interleave", ()),
    "separate, 2 dev": (2, "separate", ()),
    "colocate, actor tp2": (2, None, ("runtime.layouts={actor: {tp: 2}}",)),
    "colocate, actor+critic pp2": (2, None, ("runtime.layouts={actor: {pp: 2}, critic: {pp: 2}}",)),
    "colocate dp4": (4, "colocate", ()),
    "interleave, 4 dev": (4, "interleave", ()),
    "separate, 4 dev": (4, "separate", ()),
    "colocate dp2, ZeRO-1": (
        2,
        "actor_gen=0-1; ref_inf=0-1; reward_inf=0-1; critic_inf=0-1; actor_train=0-1:dp2zero; critic_train=0-1:dp2zero",
        (),
    ),
    "colocate dp4, ZeRO-1": (
        4,
        "actor_gen=0-3; ref_inf=0-3; reward_inf=0-3; critic_inf=0-3; actor_train=0-3:dp4zero; critic_train=0-3:dp4zero",
        (),
    ),
    "colocate dp2, FSDP": (
        2,
        (
            "actor_gen=0-1; ref_inf=0-1; reward_inf=0-1; critic_inf=0-1; "
            "actor_train=0-1:dp2fsdp; critic_train=0-1:dp2fsdp"
        ),
        (),
    ),
    "colocate dp4, FSDP": (
        4,
        (
            "actor_gen=0-3; ref_inf=0-3; reward_inf=0-3; critic_inf=0-3; "
            "actor_train=0-3:dp4fsdp; critic_train=0-3:dp4fsdp"
        ),
        (),
    ),
    "colocate dp2tp2, FSDP": (
        4,
        None,
        (("runtime.layouts={actor: {tp: 2, sharding: fsdp}, critic: {tp: 2, sharding: fsdp}}"),),
    ),
}


def run_all(tmp: Path, setups: dict, iterations: int, prompts: int, offset: int) -> dict[str, Path]:
    out = {}
    for i, (name, (devices, plan, extra)) in enumerate(setups.items()):
        run_dir = f"run{offset + i}"
        run_ppo(
            tmp,
            run_dir,
            iterations,
            prompts,
            "runtime.executor=ray",
            f"runtime.devices={devices}",
            "runtime.threads=1",
            *extra,
            plan=plan,
        )
        out[name] = tmp / run_dir
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--keep", default=None, help="copy the run directories here (for `loomrl calibrate --from`)")
    args = ap.parse_args()
    quiet_libraries()
    started = time.perf_counter()
    cores = usable_cores()
    profile = calibrate_local(1)  # one worker's rates: every run gives each worker one torch thread
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        prepare(tmp)
        calibration = run_all(tmp, CALIBRATION, args.iterations, args.prompts, 0)
        evaluated = run_all(tmp, EVALUATED, args.iterations, args.prompts, len(CALIBRATION))
        corrections = fit_from_runs(list(calibration.values()), profile, cores)
        rows = []
        for group, runs in (("calibration", calibration), ("evaluated", evaluated)):
            for name, path in runs.items():
                run = load_run(path, profile, cores)
                predicted = simulate_run(run, corrections).iteration_time
                measured = run.measured_iteration_s()
                rows.append(
                    {
                        "plan": name,
                        "role": group,
                        "devices": run.inputs.cluster.n_devices,
                        "measured s": measured,
                        "predicted s": predicted,
                        "error": abs(predicted - measured) / measured,
                    }
                )
        if args.keep:
            shutil.copytree(tmp, args.keep, dirs_exist_ok=True)
    errors = [r["error"] for r in rows if r["role"] == "evaluated"]
    console = Console()
    console.print(
        summary_table(
            rows,
            f"Estimator accuracy: demo PPO workload, {args.prompts} prompts, median of "
            f"{args.iterations - 1} iterations",
        )
    )
    console.print(
        f"evaluated plans: {len(errors)}; median error {statistics.median(errors):.1%}, "
        f"max {max(errors):.1%} (target 15%, goal 10%)"
    )
    console.print(f"corrections: {corrections.dumps()}")
    console.print(f"profile: {profile}")
    console.print(f"wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
