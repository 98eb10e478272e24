"""SmolLM2-135M-Instruct with and without a calculator tool: a short SFT warm start, then GRPO, on harder arithmetic.

    .venv/bin/python benchmarks/smollm2_calculator.py [--level 3] [--sft-steps 30] [--iterations 10] [--seed 0]

Two arms from the same pretrained model, the same prompts and the same number of samples:

- **tool**: SFT on demonstrations played through the calculator environment (a Hermes tool call, the tool's
  result, then the answer; the loss on the model's turns only), then multi-turn GRPO with the calculator
  (``rollout.env.name=calculator``);
- **no tool**: SFT on the plain answers of the same prompts, then GRPO on single responses.

Both: ``task.name=arith`` at ``--level``, SFT ``--sft-steps`` × 8 demonstrations, GRPO 16 prompts × 8 samples,
temperature 0.7, lr 1e-5, KL 0, the reference executor. Printed: held-out greedy accuracy (100 prompts) of the base
model, after SFT and after GRPO, per arm, and the time each stage took.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rich.console import Console  # noqa: E402

from loomrl.config.schema import SFTConfig, TrainConfig  # noqa: E402
from loomrl.config.tools import load_config  # noqa: E402
from loomrl.report import summary_table  # noqa: E402
from loomrl.train.rl import RLTrainer  # noqa: E402
from loomrl.train.sft import run_sft  # noqa: E402

MODEL = "smollm2-135m-instruct"


def sft(tmp: Path, arm: str, args) -> tuple[Path, float, float]:
    out = tmp / f"sft_{arm}"
    env = ["env.name=calculator", "max_new_tokens=72"] if arm == "tool" else ["max_new_tokens=16"]
    cfg = load_config(
        SFTConfig,
        None,
        [
            f"model={MODEL}",
            f"out_dir={out}",
            f"seed={args.seed}",
            "task.name=arith",
            f"task.level={args.level}",
            f"steps={args.sft_steps}",
            "batch_size=8",
            "optim.lr=5e-5",
            "eval_prompts=100",
            *env,
        ],
    )
    t0 = time.perf_counter()
    summary = run_sft(cfg, progress=False)
    return out, summary["eval/exact_match"], time.perf_counter() - t0


def grpo(tmp: Path, arm: str, model: Path, args) -> tuple[float, float, float]:
    env = (
        ["rollout.env.name=calculator", "rollout.env.max_turns=3", "rollout.env.turn_tokens=48"]
        + ["rollout.max_new_tokens=128"]
        if arm == "tool"
        else ["rollout.max_new_tokens=16"]
    )
    cfg = load_config(
        TrainConfig,
        None,
        [
            f"run_dir={tmp / f'grpo_{arm}'}",
            f"seed={args.seed}",
            f"actor.model={model}",
            "actor.optim.lr=1e-5",
            "task.name=arith",
            f"task.level={args.level}",
            "algo.name=grpo",
            "algo.group_size=8",
            "algo.kl_coef=0",
            "algo.minibatches=1",
            "rollout.prompts_per_iter=16",
            "rollout.temperature=0.7",
            f"loop.iterations={args.iterations}",
            f"loop.eval_every={args.iterations}",
            "loop.eval_prompts=100",
            "loop.save_every=0",
            "loop.progress=false",
            "report.html=false",
            "runtime.executor=reference",
            *env,
        ],
    )
    t0 = time.perf_counter()
    RLTrainer(cfg).run()
    metrics = [json.loads(x) for x in (tmp / f"grpo_{arm}" / "metrics.jsonl").read_text().splitlines()]
    return metrics[-1]["eval/exact_match"], metrics[-1]["reward/mean"], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--level", type=int, default=3)
    ap.add_argument("--sft-steps", type=int, default=30)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for arm in ("tool", "no tool"):
            model, after_sft, sft_s = sft(tmp, arm.replace(" ", "_"), args)
            after_rl, reward, rl_s = grpo(tmp, arm.replace(" ", "_"), model, args)
            rows.append(
                {
                    "arm": arm,
                    "greedy after SFT": after_sft,
                    "greedy after GRPO": after_rl,
                    "sampled reward, last iteration": reward,
                    "SFT s": round(sft_s),
                    "GRPO s": round(rl_s),
                }
            )
            Console(width=150).print(summary_table(rows, f"SmolLM2-135M, arith level {args.level}, seed {args.seed}"))


if __name__ == "__main__":
    main()
