"""SmolLM2-135M-Instruct learns arithmetic with GRPO or PPO: held-out greedy accuracy before and during training.

    .venv/bin/python benchmarks/smollm2_arith.py [--algo grpo|ppo] [--seeds 0 1 2] [--iterations N]
        [--out runs/smollm2_arith_<algo>] [overrides of examples/smollm2/<algo>.yaml ...]

For each seed: ``loomrl eval smollm2-135m-instruct`` (greedy, the 100 held-out prompts the run evaluates on, which
depend on the seed), then ``loomrl train examples/smollm2/<algo>.yaml seed=S`` (GRPO: 16 prompts × 8 samples;
PPO: 64 prompts × 1 sample, a critic initialised from the same model; both 16 new tokens, temperature 0.7, lr
1e-5, KL 0, fp32, reference executor), whose own evaluation runs every ``loop.eval_every`` iterations. Prints
each seed's curve (held-out greedy exact match against wall time from the run's start) and the median and range
over seeds of the final accuracy and of the time to reach 0.5.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from loomrl.report import summary_table

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "loomrl" / "examples" / "smollm2"
MODEL = "smollm2-135m-instruct"
TARGET = 0.5


def loomrl(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "loomrl.cli", *args], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def before(seed: int, out: Path) -> float:
    """Held-out greedy exact match of the untrained model on the seed's evaluation prompts."""
    path = out / f"before_seed{seed}.json"
    loomrl(
        "eval", MODEL, "task.name=arith", "prompts=100", "samples=0", "max_new_tokens=16", f"seed={seed}", f"out={path}"
    )
    return json.loads(path.read_text())["greedy/exact_match"]


def curve(run_dir: Path) -> list[tuple[int, float, float]]:
    """(iterations done, seconds since the run's first record began, held-out greedy exact match) per evaluation."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    start = records[0]["time"] - records[0]["time/iteration_s"]
    return [(r["iteration"] + 1, r["time"] - start, r["eval/exact_match"]) for r in records if "eval/exact_match" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algo", choices=("grpo", "ppo"), default="grpo")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--iterations", type=int, help="iterations per run (default: the config's)")
    ap.add_argument("--out", help="where the runs go (default: runs/smollm2_arith_<algo>)")
    ap.add_argument("overrides", nargs="*", help="overrides of the run's config, e.g. rollout.temperature=1.0")
    args = ap.parse_args()
    out = (ROOT / (args.out or f"runs/smollm2_arith_{args.algo}")).resolve()
    iterations = [f"loop.iterations={args.iterations}"] if args.iterations else []
    out.mkdir(parents=True, exist_ok=True)
    rows, finals, reach = [], [], []
    for seed in args.seeds:
        accuracy = before(seed, out)
        run_dir = out / f"seed{seed}"
        started = time.perf_counter()
        loomrl(
            "train",
            str(CONFIGS / f"{args.algo}.yaml"),
            f"seed={seed}",
            *iterations,
            f"run_dir={run_dir}",
            "loop.progress=false",
            *args.overrides,
        )
        wall = time.perf_counter() - started
        points = curve(run_dir)
        rows.append({"seed": seed, "iterations": 0, "minutes": 0.0, "held-out greedy": accuracy})
        rows += [{"seed": seed, "iterations": i, "minutes": s / 60, "held-out greedy": a} for i, s, a in points]
        finals.append(points[-1][2])
        reached = next((s for _, s, a in points if a >= TARGET), None)
        reach.append(reached)
        print(f"seed {seed}: {accuracy:.2f} -> {points[-1][2]:.2f} in {wall / 60:.1f} min of wall time", flush=True)
    console = Console()
    console.print(summary_table(rows, f"SmolLM2-135M-Instruct, {args.algo.upper()} on arith level 1"))
    console.print(
        f"final held-out greedy: median {statistics.median(finals):.2f} (range {min(finals):.2f}-{max(finals):.2f})"
    )
    minutes = [r / 60 for r in reach if r is not None]
    if minutes:
        console.print(
            f"minutes to reach {TARGET}: median {statistics.median(minutes):.1f} (range {min(minutes):.1f}-"
            f"{max(minutes):.1f}); {len(minutes)} of {len(reach)} seeds reached it"
        )
    else:
        console.print(f"no seed reached {TARGET}")


if __name__ == "__main__":
    main()
