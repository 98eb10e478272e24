"""A trained role's state as named local tensors, to move with the reallocation machinery on a plan change.

A role's state is its weights, Adam's two moments and (for 16-bit weights) fp32 master weights, each divided
over the devices as its training allocation keeps it (:meth:`loomrl.plan.plan.Allocation.dp_split`): the
weights by the layout (and FSDP's rows), the optimizer state like the weights or, under ZeRO-1, in flat blocks
per data-parallel rank. Each kind of state is a set of tensors with the weights' names and shapes, so one
reallocation plan per kind moves it (``state=True`` for the optimizer's kinds), and these helpers name what
this device holds of each kind, on either side of the move.
"""

from __future__ import annotations

import torch

from loomrl.models.lora import moving_parameters
from loomrl.parallel.data_parallel import local_shard
from loomrl.parallel.zero import MASTER, ZeroAdamW

__all__ = ["MOMENTS", "init_state", "state_steps", "state_tensors", "steps_taken"]

MOMENTS = ("exp_avg", "exp_avg_sq")
"""Adam's per-parameter moments."""


def state_tensors(model: torch.nn.Module, optimizer, kind: str) -> dict[str, torch.Tensor]:
    """This device's local tensors of ``kind`` (``weights``, ``master`` or a moment), by parameter name.

    ``master`` is the exact fp32 weights: a :class:`ZeroAdamW`'s master chunks for 16-bit weights, else the
    weights themselves (fp32 weights, FSDP's fp32 shards). Moments exist only once the optimizer has stepped
    (or :func:`init_state` made them)."""
    if kind == "weights":  # what moves: every weight, or a LoRA model's adapters (its base is built in place)
        params = dict(moving_parameters(model))
    else:
        params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if kind == "weights" or (kind == MASTER and not _keeps_masters(model, optimizer)):
        return {name: local_shard(p.detach()) for name, p in params.items()}
    if isinstance(optimizer, ZeroAdamW):
        return optimizer.named_state(kind)
    out = {}
    for name, p in params.items():
        state = optimizer.state.get(p)
        if state and kind in state:
            out[name] = local_shard(state[kind])
    return out


def _keeps_masters(model: torch.nn.Module, optimizer) -> bool:
    """Whether the optimizer keeps master weights apart from the weights (16-bit weights under ZeroAdamW)."""
    return isinstance(optimizer, ZeroAdamW) and any(
        p.dtype != torch.float32 for p in model.parameters() if p.requires_grad
    )


def init_state(model: torch.nn.Module, optimizer, step: int) -> None:
    """Zero moments at ``step`` steps for every trained parameter: the tensors a moved state lands in (AdamW's
    own layout of them, so its next step continues as if it had taken the previous ones)."""
    if isinstance(optimizer, ZeroAdamW):
        optimizer.init_state(step)
        return
    for p in model.parameters():
        if p.requires_grad:
            optimizer.state[p] = {
                "step": torch.tensor(float(step), dtype=torch.float32),
                **{k: torch.zeros_like(p, memory_format=torch.preserve_format) for k in MOMENTS},
            }


def steps_taken(optimizer) -> int:
    """Optimizer steps taken so far (0 before the first)."""
    if isinstance(optimizer, ZeroAdamW):
        return optimizer.steps_taken()
    return max((int(st["step"]) for st in optimizer.state.values() if "step" in st), default=0)


def state_steps(model: torch.nn.Module, optimizer) -> dict[str, float]:
    """Steps taken by each trained parameter this device holds optimizer state of, by parameter name (a parameter
    never stepped has none)."""
    if isinstance(optimizer, ZeroAdamW):
        return optimizer.named_steps()
    out = {}
    for name, p in model.named_parameters():
        state = optimizer.state.get(p)
        if state and "step" in state:
            out[name] = float(state["step"])
    return out
