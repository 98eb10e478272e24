"""`loomrl config`: every field of a command's config with its type, default and meaning."""

from __future__ import annotations

import argparse

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    from loomrl.config.schema import EvalConfig, RMConfig, SFTConfig, TrainConfig
    from loomrl.config.tools import describe

    cls = {"train": TrainConfig, "sft": SFTConfig, "rm": RMConfig, "eval": EvalConfig}[args.command]
    for path, type_name, default, doc in describe(cls):
        print(f"{path:32} {type_name:18} {default:14} {doc}")
    return 0
