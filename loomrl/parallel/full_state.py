"""Full (unsharded) state dicts of possibly tensor-parallel models: for checkpoints and for comparisons.

The keys are those of the plain HF model (parallelising a model does not rename anything), so a full state
dict of a sharded model loads into an unsharded one with ``load_state_dict`` and vice versa.

Both functions are collective over the tensor-parallel group when the model holds DTensors: every rank of the
group must call them, on the same model, at the same time (gathering is an all-gather per parameter, in the
model's deterministic parameter order).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer as a full, detached CPU tensor (a copy, never a view)."""
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            out[name] = full.detach().to("cpu", copy=True)
    return out


def load_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Copy full tensors into ``model``'s parameters and buffers in place, keeping each one's sharding.

    Every rank holds the full tensors already, so each takes its own shard locally (no communication). Shapes
    must be the full (unsharded) ones. ``strict``: the keys must be exactly the model's; otherwise a subset
    is fine (e.g. new weights of the trained parameters only) but an unknown key is still an error.
    """
    targets = model.state_dict(keep_vars=True)
    missing = sorted(set(targets) - set(state)) if strict else []
    unexpected = sorted(set(state) - set(targets))
    if missing or unexpected:
        raise ValueError(
            f"state dict does not fit the model: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    with torch.no_grad():
        for name, full in state.items():
            target = targets[name]
            if tuple(full.shape) != tuple(target.shape):  # a DTensor's shape is its full shape
                raise ValueError(f"{name}: full shape {tuple(target.shape)} expected, got {tuple(full.shape)}")
            if isinstance(target, DTensor):
                local = target.to_local()
                shard = distribute_tensor(
                    full.to(local.device, local.dtype), target.device_mesh, target.placements, src_data_rank=None
                ).to_local()
                local.copy_(shard)
            else:
                target.copy_(full)
