"""`loomrl sft` and `loomrl rm`: supervised warm start and reward-model training from a config and overrides."""

from __future__ import annotations

import argparse

from loomrl.commands.common import config_and_overrides, summary_line

__all__ = ["run_rm_command", "run_sft_command"]


def run_sft_command(args: argparse.Namespace) -> int:
    from loomrl.config.schema import SFTConfig
    from loomrl.config.tools import load_config
    from loomrl.train.sft import run_sft

    path, overrides = config_and_overrides(args.config)
    cfg = load_config(SFTConfig, path, overrides)
    print(summary_line(run_sft(cfg, progress=not args.quiet), ("loss", "eval/exact_match", "eval/score")))
    print(f"checkpoint: {cfg.out_dir}")
    return 0


def run_rm_command(args: argparse.Namespace) -> int:
    from loomrl.config.schema import RMConfig
    from loomrl.config.tools import load_config
    from loomrl.train.rm import run_rm

    path, overrides = config_and_overrides(args.config)
    cfg = load_config(RMConfig, path, overrides)
    print(summary_line(run_rm(cfg, progress=not args.quiet), ("loss", "eval/pair_accuracy")))
    print(f"checkpoint: {cfg.out_dir}")
    return 0
