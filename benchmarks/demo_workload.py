"""The demo's PPO workload for benchmarks: a short SFT warm start, a small reward model, then PPO runs.

Shared by benchmarks/runtime_overhead.py and benchmarks/placement.py so both measure the same thing.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from loomrl.config.schema import RMConfig, SFTConfig, TrainConfig
from loomrl.config.tools import load_config
from loomrl.train.rl import RLTrainer
from loomrl.train.rm import run_rm
from loomrl.train.sft import run_sft

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "demo"


def prepare(tmp: Path) -> None:
    """Warm-start policy (tmp/sft) and reward model (tmp/rm), as the demo makes them but smaller."""
    run_sft(load_config(SFTConfig, EXAMPLES / "sft.yaml", [f"out_dir={tmp / 'sft'}"]), progress=False)
    run_rm(
        load_config(
            RMConfig,
            EXAMPLES / "rm.yaml",
            [f"out_dir={tmp / 'rm'}", f"model={tmp / 'sft'}", "train_pairs=256", "epochs=1"],
        ),
        progress=False,
    )


def run_ppo(tmp: Path, name: str, iterations: int, prompts: int, *extra: str, plan: str | None = None) -> list[dict]:
    """The demo's PPO config for ``iterations`` from the prepared checkpoints; returns its metrics lines."""
    cfg = load_config(
        TrainConfig,
        EXAMPLES / "ppo.yaml",
        [
            f"run_dir={tmp / name}",
            f"actor.model={tmp / 'sft'}",
            f"reward.model={tmp / 'rm'}",
            f"loop.iterations={iterations}",
            "loop.eval_every=0",
            "loop.save_every=0",
            "loop.eval_prompts=16",
            "loop.progress=false",
            "report.html=false",
            f"rollout.prompts_per_iter={prompts}",
            *extra,
        ],
    )
    if plan is not None:
        cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan=plan))
    RLTrainer(cfg).run()
    return [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines()]
