"""Which attention kernel a model computes with, chosen by the device it runs on.

On CUDA, training, scoring and the rollout engine's decode run attention through
``torch.nn.functional.scaled_dot_product_attention`` (transformers' ``sdpa``), which dispatches to the flash or
memory-efficient kernels: no B×heads×Q×K score tensor in memory, and one kernel instead of five. On CPU every
model keeps transformers' ``eager`` attention, the reference implementation the equivalence tests compare
against (``sdpa`` on CPU differs from it by ~5e-7 in the logits and is no faster at these sizes). Tests select
``sdpa`` on CPU to check its logic against ``eager``.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

__all__ = ["EAGER", "SDPA", "attention_for", "uses_sdpa", "use_attention"]

EAGER, SDPA = "eager", "sdpa"


def attention_for(device: torch.device) -> str:
    """The attention kernel of models computing on ``device``."""
    return SDPA if device.type == "cuda" else EAGER


def use_attention(model: PreTrainedModel, kind: str) -> PreTrainedModel:
    """``model`` switched to attention ``kind`` (in place; a no-op when it already uses it)."""
    if getattr(model.config, "_attn_implementation", None) != kind:
        model.set_attn_implementation(kind)
    return model


def uses_sdpa(model: PreTrainedModel) -> bool:
    """Whether ``model`` computes attention with ``scaled_dot_product_attention``."""
    return getattr(model.config, "_attn_implementation", None) == SDPA
