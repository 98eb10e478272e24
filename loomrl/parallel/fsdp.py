"""Fully sharded data parallelism (FSDP, ZeRO stage 3) for a trained role, with PyTorch's FSDP2 ``fully_shard``.

Each rank of the data-parallel group keeps one ``torch.chunk`` block of dim 0 of every parameter (a DTensor
with placement ``Shard(0)``, the convention :mod:`loomrl.plan.shards` prices and reallocates from), its
gradient and its optimizer state. On a model already split by tensor parallelism (DTensors on the tp mesh),
the block is one of the rank's tensor-parallel shard: FSDP2 joins the dp and tp meshes of the allocation into
2-D DTensors, as torchtitan does. Every decoder layer is its own FSDP unit: its weights are all-gathered for its
forward and again for its backward, then freed, and its gradients are reduce-scattered as the backward leaves
it, so a device never holds more than a few whole layers. The root unit holds the rest (embedding, final
norm, head).

Two settings make it compute what the single-process reference does:

- **A sum, not a mean.** The training loop already scales each rank's loss by its share of the step's tokens
  (:mod:`loomrl.parallel.data_parallel`), so the gradients must be *summed* over the group: every unit's
  divide factor is 1, reduced with ``ReduceOp.SUM`` alone (gloo has no pre-multiplied sum).
- **fp32 shards, 16-bit compute.** The sharded weights stay fp32 whatever ``runtime.precision`` says; under bf16
  a :class:`~torch.distributed.fsdp.MixedPrecisionPolicy` gathers them as bf16 and reduces the gradients in
  fp32. The fp32 shards are then the optimizer's master weights, so a plain AdamW steps them (no
  :class:`~loomrl.parallel.zero.ZeroAdamW`, no ``main_grad`` hook), as verl's FSDP workers do.

Collectives run inside every forward and backward, so all ranks of the group must run the same number of them:
the training loop runs exactly the plan's micro-batches on every rank, a rank short of rows running passes that
add nothing (:func:`loomrl.algorithms.ops.idle_pass`). Generation and inference, whose passes differ per rank,
never run on an FSDP model: the plan gives them a reallocated whole copy.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from loomrl.models.heads import is_value_model, score_head
from loomrl.models.lora import adapter_modules, has_adapters

__all__ = ["apply_fsdp"]


def _units(model: nn.Module) -> list[nn.Module]:
    """The submodules sharded as units of their own: the decoder layers (the classes an HF model lists in
    ``_no_split_modules``), and for a value model its backbone and score head, which
    :func:`~loomrl.models.heads.token_values` calls one after the other rather than through the root."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if is_value_model(model):
        units += [model.base_model, score_head(model)]
    return units


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, compute_dtype: torch.dtype) -> nn.Module:
    """Shard ``model`` (in place, before any optimizer sees it, after tensor parallelism if any) over the
    one-dimensional ``dp_mesh``; its weights become fp32 shards, computed with in ``compute_dtype``. Returns
    the model."""
    model.float()  # exact for bf16 weights: every precision starts from the same values
    policy = (
        MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        if compute_dtype != torch.float32
        else MixedPrecisionPolicy()
    )
    # LoRA adapters (and a LoRA value model's head) compute in fp32 over a 16-bit base, as on one device: a group
    # of their own per unit, gathered in fp32
    exact = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    adapters = has_adapters(model) and compute_dtype != torch.float32
    for unit in _units(model):
        own = adapter_modules(unit) if adapters else []
        if own:
            fully_shard(own, mesh=dp_mesh, mp_policy=exact)
        head = adapters and is_value_model(model) and unit is score_head(model)
        fully_shard(unit, mesh=dp_mesh, mp_policy=exact if head else policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model
