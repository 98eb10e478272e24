"""Low-rank adapters (LoRA) on plain HF models, through ``peft``, and what the rest of loomrl asks of them.

:func:`add_adapters` injects peft's LoRA layers into a model in place (``peft.inject_adapter_in_model``): the
model stays the HF class it was (``LlamaForCausalLM``, its ``config``, ``model.layers``, ``lm_head``), so every
pass, the rollout engine and the parallel layers see the model they know; a targeted projection becomes a peft
``lora.Linear`` whose base weight is renamed ``<proj>.base_layer.weight`` beside ``<proj>.lora_A.default.weight``
and ``<proj>.lora_B.default.weight``. The adapters are drawn from the role's seed (the same on every process),
``lora_B`` at zero, so a fresh LoRA model computes exactly its base.

What trains and moves: the adapters (and a value model's score head, trained in full as peft's
``modules_to_save`` would) are the role's *moving* parameters (:func:`is_moving`); the base is frozen, built from
the role's spec wherever a layout needs it, and never moves or enters a checkpoint again. Without adapters every
parameter moves.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer

from loomrl.config.schema import LoraConfig

__all__ = [
    "ADAPTER",
    "add_adapters",
    "adapters_off",
    "has_adapters",
    "is_moving",
    "moving_parameters",
    "peft_config",
    "to_precision",
]

ADAPTER = "default"
"""peft's name of the one adapter a role has (its parameters' ``lora_A.default`` part)."""

_HEADS = ("score.",)
"""A value model's head: trained in full beside the adapters."""


def peft_config(lora: LoraConfig) -> PeftLoraConfig:
    """peft's config for ``lora`` (the one an exported adapter directory holds)."""
    return PeftLoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules)
    )


def add_adapters(model: torch.nn.Module, lora: LoraConfig, seed: int) -> torch.nn.Module:
    """Inject ``lora``'s adapters into ``model`` in place and return it: the base frozen, the adapters (drawn from
    ``seed``) trainable, a value model's score head trainable too. peft draws each adapter on the CPU before
    moving it to its layer's device, so every process draws the same; build the model in float32 and place it
    with :func:`to_precision`, which keeps the adapters in float32."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(peft_config(lora), model)
    for name, param in model.named_parameters():
        param.requires_grad_(is_moving(name, True))
    return model


def to_precision(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` on ``device`` in ``dtype``, its adapters (if any) kept in float32 as they were: a 16-bit update
    of a low-rank adapter would round most of it away."""
    if not has_adapters(model):
        return model.to(device, dtype)
    kept = {n: p.detach().float() for n, p in moving_parameters(model)}
    model.to(device, dtype)
    for name, param in moving_parameters(model):
        param.data = kept[name].to(device)
    return model


def has_adapters(model: torch.nn.Module | None) -> bool:
    """Whether ``model`` holds LoRA layers."""
    return model is not None and any(isinstance(m, BaseTunerLayer) for m in model.modules())


def is_moving(name: str, adapters: bool) -> bool:
    """Whether parameter ``name`` of a role trains and moves: every parameter without adapters; with them, the
    adapters' and a value model's score head."""
    return not adapters or ".lora_A." in name or ".lora_B." in name or name.startswith(_HEADS)


def moving_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of every moving parameter of ``model`` (:func:`is_moving`), in model order."""
    adapters = has_adapters(model)
    for name, param in model.named_parameters():
        if is_moving(name, adapters):
            yield name, param


@contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` computing its base: every LoRA layer's adapter disabled inside the block, restored after."""
    # peft's enable_adapters() also flips the adapters' requires_grad; only the switch its forward reads is wanted
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield model
    finally:
        for layer in layers:
            layer._disable_adapters = False
