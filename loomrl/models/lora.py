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

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer

from loomrl.config.schema import LoraConfig

__all__ = [
    "ADAPTER",
    "adapter_modules",
    "add_adapters",
    "adapter_description",
    "adapter_state",
    "adapters_off",
    "has_adapters",
    "is_moving",
    "merge_adapters",
    "moving_parameters",
    "peft_config",
    "to_precision",
]

ADAPTER = "default"
"""peft's name of the one adapter a role has (its parameters' ``lora_A.default`` part)."""

_DESCRIPTION = "loomrl_adapters"
"""The attribute of a LoRA model holding :func:`adapter_description` (as peft keeps its ``peft_config`` there)."""

_HEADS = ("score.",)
"""A value model's head: trained in full beside the adapters."""


def peft_config(lora: LoraConfig) -> PeftLoraConfig:
    """peft's config for ``lora`` (the one an exported adapter directory holds)."""
    return PeftLoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules)
    )


def add_adapters(model: torch.nn.Module, lora: LoraConfig, seed: int, base: str | None = None) -> torch.nn.Module:
    """Inject ``lora``'s adapters into ``model`` in place and return it: the base frozen, the adapters (drawn from
    ``seed``) trainable, a value model's score head trainable too. peft draws each adapter on the CPU before
    moving it to its layer's device, so every process draws the same; build the model in float32 and place it
    with :func:`to_precision`, which keeps the adapters in float32.

    ``base``: the model the base was built from (a zoo name, drawn from ``seed``, or a checkpoint directory); the
    model carries it (:func:`adapter_description`) so that a checkpoint, which holds the adapters only, says
    what they adapt."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(peft_config(lora), model)
    for name, param in model.named_parameters():
        param.requires_grad_(is_moving(name, True))
    lora_fields = {f.name: getattr(lora, f.name) for f in dataclasses.fields(lora)}
    setattr(model, _DESCRIPTION, {"lora": lora_fields, "base": base, "seed": seed})
    return model


def adapter_description(model: torch.nn.Module) -> dict[str, Any] | None:
    """What a checkpoint records of ``model``'s adapters (JSON): ``{"lora": the LoraConfig's fields, "base": the
    base model, "seed": its seed}``; None for a model without adapters."""
    return getattr(model, _DESCRIPTION, None) if has_adapters(model) else None


def merge_adapters(model: torch.nn.Module) -> torch.nn.Module:
    """Fold every adapter into its base weight (W + alpha/r · B·A, in the weight's dtype) and put the plain linear
    back in the LoRA layer's place, in place: a model ``from_pretrained`` loads as its own class."""
    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.get_base_layer())
    for attr in (_DESCRIPTION, "peft_config"):
        if hasattr(model, attr):
            delattr(model, attr)
    return model


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters of ``model`` under the names a PEFT adapter file uses (``base_model.model.<module>.lora_A.
    weight``), detached on the CPU."""
    marker = f".{ADAPTER}."
    return {
        "base_model.model." + name.replace(marker, "."): param.detach().cpu().contiguous()
        for name, param in model.named_parameters()
        if ".lora_A." in name or ".lora_B." in name
    }


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


def adapter_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The adapters' linear layers (every ``lora_A`` and ``lora_B``) inside ``module``, in module order."""
    return [
        layer
        for tuner in module.modules()
        if isinstance(tuner, BaseTunerLayer)
        for part in ("lora_A", "lora_B")
        for layer in getattr(tuner, part).values()
    ]


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
