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


def run(tmp: Path, name: str, iterations: int, prompts: int, *extra: str) -> list[dict]:
    cfg = load_config(TrainConfig, EXAMPLES / "ppo.yaml", [
        f"run_dir={tmp / name}", f"actor.model={tmp / 'sft'}", f"reward.model={tmp / 'rm'}",
        f"loop.iterations={iterations}", "loop.eval_every=0", "loop.save_every=0", "loop.eval_prompts=16",
        "loop.progress=false", "loop.tensorboard=false", f"rollout.prompts_per_iter={prompts}", *extra])
    RLTrainer(cfg).run()
    return [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=64)
    args = ap.parse_args()
    quiet_libraries()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        run_sft(load_config(SFTConfig, EXAMPLES / "sft.yaml", [f"out_dir={tmp / 'sft'}"]), progress=False)
        run_rm(load_config(RMConfig, EXAMPLES / "rm.yaml", [f"out_dir={tmp / 'rm'}", f"model={tmp / 'sft'}",
                                                            "train_pairs=256", "epochs=1"]), progress=False)
        setups = {
            "reference (1 process)": ("runtime.executor=reference", "runtime.threads=2"),
            "ray, 1 device": ("runtime.executor=ray", "runtime.devices=1", "runtime.threads=2"),
            "ray, 2 devices (dp=2)": ("runtime.executor=ray", "runtime.devices=2", "runtime.threads=1"),
        }
        results = {name: run(tmp, str(i), args.iterations, args.prompts, *extra)
                   for i, (name, extra) in enumerate(setups.items())}
    base = statistics.median(m["time/iteration_s"] for m in results["reference (1 process)"][1:])
    rows = []
    for name, metrics in results.items():
        it = statistics.median(m["time/iteration_s"] for m in metrics[1:])
        ctrl = statistics.median(m.get("time/controller_s", 0.0) for m in metrics[1:])
        rows.append({"executor": name, "s/iteration": it, "vs reference": it / base,
                     "controller s": ctrl, "controller share": ctrl / it})
    Console().print(summary_table(rows, f"PPO demo workload, {args.prompts} prompts, median of "
                                        f"{args.iterations - 1} iterations"))


if __name__ == "__main__":
    main()
