"""Optimizer state in the full, parameter-name-keyed form, so checkpoints do not depend on the layout.

``Optimizer.state_dict()`` keys states by parameter index and, under tensor parallelism, holds only the local
shard. Checkpoints instead store the full state keyed by parameter name (torch.distributed.checkpoint's
full-state-dict form), so a run checkpointed by the reference executor resumes on any layout and back.
Getting the full state of a sharded model is a collective: every rank of the model's group must call it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from loomrl.parallel.full_state import load_full_state_dict
from loomrl.parallel.zero import MASTER, ZeroAdamW

# Not cpu_offload: with it, torch returns the full state on global rank 0 only, and the holder of a role's
# weights may be any worker. Tensors are moved to the CPU here instead.
FULL = StateDictOptions(full_state_dict=True)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


class FullOptimizerState:
    """Duck-types an optimizer's ``state_dict`` / ``load_state_dict`` for :mod:`loomrl.checkpoint.store`."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, gathered: dict | None = None):
        self.model, self.optimizer, self.gathered = model, optimizer, gathered

    def state_dict(self) -> dict[str, Any]:
        if self.gathered is not None:
            return self.gathered
        if isinstance(self.optimizer, ZeroAdamW):  # its own gather, into the same full form
            return self.optimizer.full_state_dict()
        return _to_cpu(get_optimizer_state_dict(self.model, self.optimizer, options=FULL))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load the states of this model's parameters (a pipeline stage takes its own from the full state)."""
        own = {name for name, _ in self.model.named_parameters()}
        state = {
            "state": {k: v for k, v in state["state"].items() if k in own},
            "param_groups": [{**g, "params": [p for p in g["params"] if p in own]} for g in state["param_groups"]],
        }
        if isinstance(self.optimizer, ZeroAdamW):
            self.optimizer.load_full_state_dict(state)
            return
        # A plain optimizer steps the weights themselves (fp32, or FSDP's fp32 shards): a 16-bit run's master
        # weights become them, exact where the checkpoint's weights were rounded.
        masters = {k: st[MASTER] for k, st in state["state"].items() if MASTER in st}
        if masters:
            load_full_state_dict(self.model, masters, strict=False)
        state["state"] = {k: {key: v for key, v in st.items() if key != MASTER} for k, st in state["state"].items()}
        set_optimizer_state_dict(self.model, self.optimizer, state, options=StateDictOptions(full_state_dict=True))


def with_masters(
    weights: dict[str, torch.Tensor], optim: dict[str, Any], dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The checkpoint form of an FSDP role run in 16-bit ``dtype``, whose fp32 shards are the master weights:
    weights rounded to ``dtype`` and the fp32 ones as each parameter's ``master`` state (as
    :class:`~loomrl.parallel.zero.ZeroAdamW` saves them), so every layout resumes them exactly."""
    if dtype == torch.float32:
        return weights, optim
    state = {name: {**st, MASTER: weights[name]} for name, st in optim["state"].items()}
    return {k: v.to(dtype) for k, v in weights.items()}, {**optim, "state": state}


def merge_optimizer_states(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One full optimizer state from the states of disjoint parameter sets (the stages of a pipeline)."""
    merged = {"state": {}, "param_groups": [dict(g, params=list(g["params"])) for g in parts[0]["param_groups"]]}
    for part in parts:
        merged["state"].update(part["state"])
    for part in parts[1:]:
        for group, extra in zip(merged["param_groups"], part["param_groups"]):
            group["params"] += [p for p in extra["params"] if p not in group["params"]]
    return merged
