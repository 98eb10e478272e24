"""`loomrl train`: an RL run from a config and overrides (:class:`~loomrl.train.rl.RLTrainer`)."""

from __future__ import annotations

import argparse
import dataclasses

from loomrl.commands.common import config_and_overrides, summary_line

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    from loomrl.config.schema import TrainConfig
    from loomrl.config.tools import load_config
    from loomrl.train.rl import RLTrainer

    path, overrides = config_and_overrides(args.config)
    if args.ray_address:
        overrides.append(f"runtime.ray_address={args.ray_address}")
    cfg = load_config(TrainConfig, path, overrides)
    if args.plan:  # set after parsing: plan strings hold '=' and ':' that YAML would misread
        cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, plan=args.plan))
    metrics = RLTrainer(cfg).run(resume=args.resume)
    shown = ("reward/mean", "eval/exact_match", "kl/mean", "mismatch/mean_abs_logp_diff", "response/length")
    print(summary_line(metrics, shown))
    print(f"outputs: {cfg.run_dir}")
    return 0
