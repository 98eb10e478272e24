"""The learning rate of each optimizer step: linear warm-up, then constant or cosine decay.

A pure function of the step index, not a ``torch.optim.lr_scheduler`` object: every executor and every rank
computes the same value from the same index (a run's optimizer steps are numbered by iteration, so a resumed run
needs no scheduler state), and a step's rate does not depend on how many steps ran in this process.
"""

from __future__ import annotations

import math

from loomrl.config.schema import OptimConfig

__all__ = ["learning_rate", "set_lr"]


def learning_rate(optim: OptimConfig, step: int, total_steps: int) -> float:
    """The rate of optimizer step ``step`` (0-based) of a run of ``total_steps`` steps under ``optim``."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.lr_schedule == "constant":
        return optim.lr
    decay_steps = max(1, total_steps - optim.warmup_steps - 1)
    progress = min(1.0, (step - optim.warmup_steps) / decay_steps)
    return optim.lr * (optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def set_lr(optimizer, lr: float) -> None:
    """Use learning rate ``lr`` for the optimizer's next steps (every parameter group)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
