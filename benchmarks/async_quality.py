"""Does asynchronous training learn as well? Held-out accuracy after the same samples, synchronous and stale.

    .venv/bin/python benchmarks/async_quality.py [--seeds 0 1 2] [--iterations 60] [--prompts 32] [--group 4]

The workload: digit sorting (lengths 3-5), a llama-1m policy warm-started by the demo's short SFT stage (one
SFT run, seed 0, shared by every RL run), then GRPO (groups of ``--group``, the task's rule reward, no KL) on the
reference executor, which computes an asynchronous plan's interleaving exactly (iteration i trains on the batch
generated with the weights of iteration i - N). Variants, each for every seed of ``--seeds``:

- ``synchronous``: staleness 0 (on-policy);
- ``async=1 decoupled`` and ``async=2 decoupled``: AReaL's decoupled objective (``algo.off_policy=decoupled``);
- ``async=4 plain``: no correction (PPO's clip around the sampler's log-probs), beside
  ``async=4 decoupled``: what the correction buys at a staleness the issue's bound does not cover.

Every run sees the same prompts in the same order and the same number of samples; the held-out greedy exact
match on ``--eval-prompts`` held-out prompts after the last iteration is reported per variant: median over
seeds and range, and whether the median lies within the synchronous seeds' range (the run-to-run spread).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from loomrl.report import summary_table

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "loomrl" / "examples" / "demo"
VARIANTS = {
    "synchronous": ("separate", "none"),
    "async=1 decoupled": ("separate; async=1", "decoupled"),
    "async=2 decoupled": ("separate; async=2", "decoupled"),
    "async=4 plain": ("separate; async=4", "none"),
    "async=4 decoupled": ("separate; async=4", "decoupled"),
}


def loomrl(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "loomrl.cli", *args], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def final_accuracy(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["eval/exact_match"] for r in records if "eval/exact_match" in r][-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per iteration")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--eval-prompts", type=int, default=256)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    ap.add_argument("--out", help="where the runs go (default: a temporary directory)")
    args = ap.parse_args()
    console = Console()
    out = Path(args.out or tempfile.mkdtemp(prefix="loomrl-async-quality-"))
    sft = out / "sft"
    if not (sft / "config.json").is_file():
        loomrl("sft", str(DEMO / "sft.yaml"), f"out_dir={sft}")
    accuracy: dict[str, list[float]] = {}
    for name in args.variants.split(","):
        plan, off_policy = VARIANTS[name]
        for seed in args.seeds:
            run_dir = out / name.replace(" ", "_").replace("=", "") / f"seed{seed}"
            loomrl(
                "train",
                f"run_dir={run_dir}",
                f"seed={seed}",
                f"actor.model={sft}",
                "task.name=sort",
                "task.min_len=3",
                "task.max_len=5",
                "reward.source=rule",
                "algo.name=grpo",
                f"algo.group_size={args.group}",
                "algo.kl_coef=0",
                f"algo.off_policy={off_policy}",
                "actor.optim.lr=0.0003",
                f"rollout.prompts_per_iter={args.prompts}",
                "rollout.max_new_tokens=8",
                f"loop.iterations={args.iterations}",
                "loop.eval_every=0",
                f"loop.eval_prompts={args.eval_prompts}",
                "runtime.executor=reference",
                "runtime.devices=2",
                f"runtime.plan={plan}",
            )
            accuracy.setdefault(name, []).append(final_accuracy(run_dir))
            console.print(f"{name} seed {seed}: {accuracy[name][-1]:.3f}")
    low, high = min(accuracy["synchronous"]), max(accuracy["synchronous"])
    rows = [
        {
            "variant": name,
            "held-out exact match (median)": statistics.median(acc),
            "range over seeds": f"{min(acc):.3f}-{max(acc):.3f}",
            "per seed": " ".join(f"{a:.3f}" for a in acc),
            "median within the synchronous spread": "yes" if low <= statistics.median(acc) <= high else "no",
        }
        for name, acc in accuracy.items()
    ]
    start = json.loads((sft / "sft_summary.json").read_text())["eval/exact_match"]
    console.print(
        f"digit sort 3-5, llama-1m after the demo's SFT stage (its own held-out exact match {start:.3f}), GRPO "
        f"{args.prompts} prompts x {args.group}, {args.iterations} iterations, seeds {args.seeds}; runs in {out}"
    )
    console.print(summary_table(rows, "held-out greedy exact match after the same samples"))


if __name__ == "__main__":
    main()
