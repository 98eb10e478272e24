"""Iteration time of the demo workload under each placement strategy on 2 devices.

    .venv/bin/python benchmarks/placement.py [--iterations 6] [--prompts 64] [--devices 2]

A short SFT warm start and a small reward model, then the demo's PPO workload for the same iterations from the
same seed under colocate, interleave and separate plans (and the reference executor for scale). The first
iteration (warm-up) is excluded; the table gives the median seconds per iteration, the ratio to colocate, the
time spent in reallocation-dependent calls and the controller's share. All runs share this process and
machine, side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rich.console import Console  # noqa: E402

from loomrl.config import RMConfig, SFTConfig, TrainConfig  # noqa: E402
from loomrl.configtools import load_config  # noqa: E402
from loomrl.launch import quiet_libraries  # noqa: E402
from loomrl.report import summary_table  # noqa: E402
from loomrl.train.rl import RLTrainer  # noqa: E402
from loomrl.train.rm import run_rm  # noqa: E402
from loomrl.train.sft import run_sft  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "demo"


def run(tmp: Path, name: str, args, plan: str | None, *extra: str) -> list[dict]:
    cfg = load_config(TrainConfig, EXAMPLES / "ppo.yaml", [
        f"run_dir={tmp / name}", f"actor.model={tmp / 'sft'}", f"reward.model={tmp / 'rm'}",
        f"loop.iterations={args.iterations}", "loop.eval_every=0", "loop.save_every=0", "loop.eval_prompts=16",
        "loop.progress=false", "loop.tensorboard=false", f"rollout.prompts_per_iter={args.prompts}", *extra])
    if plan is not None:
        cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan=plan))
    RLTrainer(cfg).run()
    return [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--devices", type=int, default=2)
    args = ap.parse_args()
    quiet_libraries()
    ray_args = ("runtime.executor=ray", f"runtime.devices={args.devices}", "runtime.threads=1")
    setups = {
        "reference (1 process, 2 threads)": (None, ("runtime.executor=reference", "runtime.threads=2")),
        "colocate": ("colocate", ray_args),
        "interleave": ("interleave", ray_args),
        "separate": ("separate", ray_args),
    }
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        run_sft(load_config(SFTConfig, EXAMPLES / "sft.yaml", [f"out_dir={tmp / 'sft'}"]), progress=False)
        run_rm(load_config(RMConfig, EXAMPLES / "rm.yaml", [f"out_dir={tmp / 'rm'}", f"model={tmp / 'sft'}",
                                                            "train_pairs=256", "epochs=1"]), progress=False)
        results = {name: run(tmp, str(i), args, plan, *extra) for i, (name, (plan, extra)) in enumerate(setups.items())}
    base = statistics.median(m["time/iteration_s"] for m in results["colocate"][1:])
    rows = []
    for name, metrics in results.items():
        it = statistics.median(m["time/iteration_s"] for m in metrics[1:])
        gen = statistics.median(m["time/actor_gen_s"] for m in metrics[1:])
        train = statistics.median(m["time/actor_train_s"] for m in metrics[1:])
        ctrl = statistics.median(m.get("time/controller_s", 0.0) for m in metrics[1:])
        rows.append({"placement": name, "s/iteration": it, "vs colocate": it / base, "actor_gen s": gen,
                     "actor_train s": train, "controller share": ctrl / it})
    Console().print(summary_table(rows, f"PPO demo workload, {args.prompts} prompts, {args.devices} devices, median "
                                        f"of {args.iterations - 1} iterations"))


if __name__ == "__main__":
    main()
