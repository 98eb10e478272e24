"""`loomrl demo --model NAME`: GRPO on a pretrained chat model (SmolLM2-135M-Instruct) on the arithmetic task.

The run is the package's ``examples/smollm2/grpo.yaml`` with the model named; the held-out greedy accuracy of the
model is measured before training on the prompts the run then evaluates on, so the table's two accuracies are of
the same questions.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from loomrl.commands.demo import demo_configs
from loomrl.config.schema import EvalConfig, TrainConfig
from loomrl.config.tools import load_config, to_dict
from loomrl.errors import ConfigError
from loomrl.models.pretrained import PRETRAINED
from loomrl.report import summary_table
from loomrl.run_dir import RunDir
from loomrl.train.evaluation import run_eval
from loomrl.train.rl import RLTrainer

__all__ = ["pretrained_demo_config", "run_pretrained_demo"]

STAGE = "grpo"
"""The prefix of the demo's overrides (``grpo.loop.iterations=20``)."""


def pretrained_demo_config(model: str, out: Path, overrides: Sequence[str]) -> TrainConfig:
    """The GRPO run of the demo: the shipped config with ``model``, writing under ``out``."""
    if model not in PRETRAINED:
        raise ConfigError(f"demo --model: '{model}' is not a pretrained model (valid: {', '.join(PRETRAINED)})")
    stage = []
    for item in overrides:
        prefix, _, rest = item.partition(".")
        if prefix != STAGE or not rest:
            raise ConfigError(f"demo override '{item}': with --model, overrides start with '{STAGE}.'")
        stage.append(rest)
    path = demo_configs().parent / "smollm2" / "grpo.yaml"
    return load_config(TrainConfig, path, [f"actor.model={model}", f"run_dir={out / STAGE}", *stage])


def run_pretrained_demo(model: str, out_dir: str, overrides: Sequence[str] = ()) -> dict:
    console = Console()
    out = Path(out_dir)
    cfg = pretrained_demo_config(model, out, overrides)  # validated before any work
    out.mkdir(parents=True, exist_ok=True)
    console.rule(f"[bold]1/2 {model} before training: held-out greedy accuracy")
    t0 = time.perf_counter()
    before_cfg = load_config(
        EvalConfig,
        None,
        base={
            "model": model,
            "task": to_dict(cfg.task),
            "prompts": cfg.loop.eval_prompts,
            "samples": 0,
            "max_new_tokens": cfg.rollout.max_new_tokens,
            "seed": cfg.seed,
            "out": str(out / "before.json"),
            "device": cfg.runtime.device,
            "precision": cfg.runtime.precision,
        },
    )
    before = run_eval(before_cfg, out)
    before_s = time.perf_counter() - t0
    console.rule(f"[bold]2/2 GRPO, {cfg.loop.iterations} iterations of {cfg.rollout.prompts_per_iter} prompts")
    t0 = time.perf_counter()
    after = RLTrainer(cfg).run()  # its last iteration is always evaluated
    grpo_s = time.perf_counter() - t0
    summary = {
        "model": model,
        "before": before["greedy/exact_match"],
        "after": after["eval/exact_match"],
        "before_seconds": before_s,
        "grpo_seconds": grpo_s,
        "iterations": cfg.loop.iterations,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    accuracy = "held-out greedy exact match"
    rows = [
        {"stage": "before", "seconds": before_s, accuracy: summary["before"]},
        {"stage": f"GRPO ({cfg.loop.iterations} iterations)", "seconds": grpo_s, accuracy: summary["after"]},
    ]
    console.print(summary_table(rows, f"loomrl demo --model {model}: arithmetic, {cfg.loop.eval_prompts} held-out"))
    run = RunDir(cfg.run_dir)
    console.print(
        f"held-out greedy exact match: {summary['before']:.2f} -> {summary['after']:.2f}; run {cfg.run_dir} "
        f"(metrics.jsonl, checkpoints/); run report {run.report}; summary {out / 'summary.json'}"
    )
    return summary
