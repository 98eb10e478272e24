"""The Hugging Face forms of a LoRA role's checkpoint: its adapters merged into the base, or a PEFT adapter.

A LoRA role's checkpoint holds its adapters (and a value model's score head) and their optimizer state only; its
index entry records what they adapt (:func:`loomrl.models.lora.adapter_description`: the LoRA settings, the base
model and its seed). An export builds the base again from that record (a zoo model drawn from the seed with the
checkpoint's tokenizer, or the checkpoint directory the run started from, which must still exist), puts the saved
adapters on it, and writes either

- ``merged``: the adapters folded into the base weights (W + alpha/r · B·A), a plain ``save_pretrained`` model of
  the base's class that ``from_pretrained`` loads without peft; or
- ``adapter``: a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``) that
  ``PeftModel.from_pretrained(base, dir)`` loads onto the base, its config naming the base as
  ``base_model_name_or_path``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from loomrl.config.schema import LoraConfig
from loomrl.errors import CheckpointError, DataError
from loomrl.models.lora import adapter_state, add_adapters, merge_adapters, peft_config
from loomrl.models.zoo import build_causal_lm, build_value_model

__all__ = ["EXPORT_FORMS", "export_adapters"]

EXPORT_FORMS = ("merged", "adapter")
"""What ``loomrl export`` writes of a LoRA role."""


def export_adapters(
    path: Path,
    role: str,
    entry: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    tokenizer: Any,
    out: Path,
    form: str,
) -> None:
    """Write ``role`` of the checkpoint ``path`` (its index ``entry`` and saved ``weights``: the adapters) into
    ``out`` in ``form`` (:data:`EXPORT_FORMS`); the tokenizer goes beside it."""
    description = entry["adapters"]
    value = entry["class"].endswith("ForSequenceClassification")
    if form == "adapter" and value:
        raise CheckpointError(
            f"{path}: '{role}' is a value model; a PEFT adapter form exists for language models only (valid: merged)"
        )
    base, seed = description["base"], int(description["seed"])
    lora = LoraConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in description["lora"].items()})
    try:
        model = (build_value_model if value else build_causal_lm)(base, tokenizer, seed)
    except DataError as err:
        raise CheckpointError(f"{path}: the base of {role}'s adapters is gone ({err})") from None
    add_adapters(model, lora, seed, base=base)
    targets = dict(model.named_parameters())
    unknown = sorted(set(weights) - set(targets))
    if unknown:
        raise CheckpointError(f"{path}: {role}'s adapters do not fit its base (unknown '{unknown[0]}')")
    with torch.no_grad():
        for name, tensor in weights.items():
            targets[name].copy_(tensor)
    if form == "adapter":
        _write_adapter(model, lora, base, out)
    else:
        merge_adapters(model).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _write_adapter(model: torch.nn.Module, lora: LoraConfig, base: str, out: Path) -> None:
    """PEFT's adapter directory: its config (base and task named) and the adapter weights under its key names."""
    out.mkdir(parents=True, exist_ok=True)
    config = peft_config(lora)
    config.base_model_name_or_path = base
    config.task_type = "CAUSAL_LM"
    config.save_pretrained(str(out))
    save_file(adapter_state(model), str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
