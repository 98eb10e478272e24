"""`loomrl eval` and `loomrl export`: a checkpoint's greedy accuracy and pass@k, and a role written in HF form."""

from __future__ import annotations

import argparse
from pathlib import Path

from loomrl.errors import DataError
from loomrl.run_dir import RunDir

__all__ = ["run_eval_command", "run_export_command"]


def run_eval_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from loomrl.report import summary_table
    from loomrl.train.evaluation import eval_config, resolve_target, run_eval

    target = resolve_target(args.checkpoint)
    cfg = eval_config(target, args.overrides)
    results = run_eval(cfg, target.out_dir)
    rows = [
        {"metric": key, "value": value}
        for key, value in results.items()
        if key.startswith(("greedy/", "pass@", "sampled_"))
    ]
    print(f"evaluated {cfg.model}")
    Console().print(summary_table(rows, f"{results['prompts']} prompts, {cfg.samples} samples each"))
    print(f"wrote {results['written_to']}")
    return 0


def run_export_command(args: argparse.Namespace) -> int:
    from loomrl.checkpoint.store import export_checkpoint, latest_checkpoint

    path = Path(args.checkpoint)
    if RunDir(path).checkpoints.is_dir():
        latest = latest_checkpoint(path)
        if latest is None:
            raise DataError(f"run '{path}': has no complete checkpoint to export")
        path = latest
    out = export_checkpoint(path, args.role, args.out, args.form)
    print(f"wrote {out}")
    return 0
