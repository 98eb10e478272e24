"""Building a role on this process from its spec: the model (loaded or drawn), its optimizer, the Role.

The reference executor and the runtime's workers both build roles here, so every process starts from the
same weights; parallelising a model for an allocation happens between :func:`build_model` and
:func:`make_role` (the optimizer must see the sharded parameters).
"""

from __future__ import annotations

from functools import partial

import torch

from loomrl.algorithms.context import Passes, Role
from loomrl.algorithms.lr import learning_rate
from loomrl.config.schema import OptimConfig
from loomrl.data.tasks import Task
from loomrl.errors import DataError
from loomrl.models.attention import attention_for, use_attention
from loomrl.models.lora import add_adapters, to_precision
from loomrl.models.zoo import build_causal_lm, build_value_model
from loomrl.parallel.main_grad import accumulate_in_fp32
from loomrl.role.spec import RoleSpec

__all__ = ["adamw", "build_model", "make_role"]


def build_model(spec: RoleSpec, tokenizer, device: torch.device, dtype: torch.dtype) -> torch.nn.Module | None:
    """The role's initial model in ``dtype`` on ``device`` (drawn or loaded in fp32, then rounded, so every
    precision starts alike; its LoRA adapters, if the spec has them, drawn from its seed and kept in fp32) with
    the device's attention kernel (:mod:`loomrl.models.attention`); frozen roles in eval mode without gradients;
    None for a role without a model."""
    if spec.model is None:
        return None
    build = build_value_model if spec.value_head else build_causal_lm
    try:
        model = build(spec.model, tokenizer, spec.seed)
    except DataError as err:
        raise DataError(f"{spec.field}: {err}") from None
    if spec.lora is not None:
        add_adapters(model, spec.lora, spec.seed, base=spec.model)
    model = use_attention(to_precision(model, device, dtype), attention_for(device))
    return model if spec.trained else model.eval().requires_grad_(False)


def adamw(model: torch.nn.Module, optim: OptimConfig, zero_group=None):
    """AdamW over ``model``'s parameters; with ``zero_group`` (a data-parallel process group) its state is
    sharded over that group (ZeRO-1, :class:`loomrl.parallel.zero.ZeroAdamW`), with the same updates. 16-bit
    weights (``precision: bf16``) get fp32 master weights in the optimizer, sharded or not."""
    if zero_group is not None or any(p.dtype != torch.float32 for p in model.parameters() if p.requires_grad):
        from loomrl.parallel.zero import ZeroAdamW

        return ZeroAdamW(
            model.named_parameters(), zero_group, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay
        )
    return torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)


def make_role(
    spec: RoleSpec,
    model: torch.nn.Module | None,
    task: Task,
    passes: Passes | None,
    *,
    trainable: bool,
    zero_group=None,
) -> Role:
    """A role around an (already parallelised) model and the engine that runs it; a trainable role gets its
    optimizer here (its state sharded over ``zero_group`` when given: ZeRO-1)."""
    if spec.name == "reward":
        return Role(
            "reward",
            model,
            rule=task.score_batch if spec.rule else None,
            rule_weight=spec.rule_weight,
            model_weight=spec.model_weight,
            passes=passes,
        )
    if not trainable or spec.optim is None:
        return Role(spec.name, model, passes=passes)
    accumulate_in_fp32(model)  # 16-bit weights sum their gradients in fp32 (fp32 models are left alone)
    return Role(
        spec.name,
        model,
        adamw(model, spec.optim, zero_group),
        spec.optim.grad_clip,
        passes=passes,
        lr_at=partial(learning_rate, spec.optim, total_steps=spec.total_steps),
        on_nonfinite=spec.on_nonfinite,
    )
