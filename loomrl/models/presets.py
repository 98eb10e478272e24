"""Published architectures to plan with, and the one reader of a model's architecture by name.

:data:`MODEL_PRESETS` holds the fields of each published model's Hugging Face ``config.json`` (no weights): the
planner prices runs of models far larger than this machine holds with them. :func:`model_config` reads an
architecture from a preset, a ``config.json`` file, a zoo model or a local checkpoint directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from loomrl.errors import ConfigError, DataError
from loomrl.plan.model_shape import ModelShape

__all__ = ["MODEL_PRESETS", "model_config", "read_config_json"]


def _decoder(
    model_type: str, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int, **extra: object
) -> SimpleNamespace:
    """An HF ``config.json`` as attributes (the fields :meth:`~loomrl.plan.model_shape.ModelShape.from_config`
    reads)."""
    return SimpleNamespace(
        model_type=model_type,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        vocab_size=vocab,
        **{"tie_word_embeddings": False, **extra},
    )


def _opt(hidden: int, layers: int, heads: int) -> SimpleNamespace:
    """OPT: plain (two-matrix) MLP of 4·hidden, tied embeddings, 50272-token vocabulary."""
    return SimpleNamespace(
        model_type="opt",
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        ffn_dim=4 * hidden,
        vocab_size=50272,
        tie_word_embeddings=True,
    )


_QWEN2 = dict(tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768)

# Published architectures, each the fields of its Hugging Face config.json (huggingface.co/<repo>/blob/main/
# config.json for the repo named beside it); any other model: give its config.json (--model path/config.json).
MODEL_PRESETS: dict[str, SimpleNamespace] = {
    # meta-llama/Llama-2-{7b,13b,70b}-hf, codellama/CodeLlama-34b-hf (the models of ReaLHF's experiments)
    "llama2-7b": _decoder("llama", 4096, 32, 32, 32, 11008, 32000),
    "llama2-13b": _decoder("llama", 5120, 40, 40, 40, 13824, 32000),
    "llama2-34b": _decoder("llama", 8192, 48, 64, 8, 22016, 32000),
    "llama2-70b": _decoder("llama", 8192, 80, 64, 8, 28672, 32000),
    # meta-llama/Llama-3.1-8B, meta-llama/Meta-Llama-3-70B (Llama 3.1 70B has the same shape), Llama-3.1-405B
    "llama3.1-8b": _decoder("llama", 4096, 32, 32, 8, 14336, 128256),
    "llama3-70b": _decoder("llama", 8192, 80, 64, 8, 28672, 128256),
    "llama3.1-70b": _decoder("llama", 8192, 80, 64, 8, 28672, 128256),
    "llama3.1-405b": _decoder("llama", 16384, 126, 128, 8, 53248, 128256),
    # Qwen/Qwen2.5-0.5B, Qwen/Qwen2.5-1.5B, meta-llama/Llama-3.2-1B (the small models of the GPU check; rope
    # scaling left out)
    "qwen2.5-0.5b": _decoder("qwen2", 896, 24, 14, 2, 4864, 151936, **_QWEN2),
    "qwen2.5-1.5b": _decoder("qwen2", 1536, 28, 12, 2, 8960, 151936, **_QWEN2),
    "llama3.2-1b": _decoder(
        "llama",
        2048,
        16,
        32,
        8,
        8192,
        128256,
        tie_word_embeddings=True,
        rope_theta=5e5,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
    ),
    # Qwen/Qwen2.5-7B (Qwen2.5-Math-7B: the same shape), Qwen/Qwen2.5-32B
    "qwen2.5-7b": _decoder("qwen2", 3584, 28, 28, 4, 18944, 152064),
    "qwen2.5-32b": _decoder("qwen2", 5120, 64, 40, 8, 27648, 152064),
    # Qwen/Qwen3-8B, Qwen/Qwen3-32B: head_dim 128 whatever the hidden size
    "qwen3-8b": _decoder("qwen3", 4096, 36, 32, 8, 12288, 151936, head_dim=128),
    "qwen3-32b": _decoder("qwen3", 5120, 64, 64, 8, 25600, 151936, head_dim=128),
    # Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B: 128 routed experts, 8 per token, no shared expert
    "qwen3-30b-a3b": _decoder(
        "qwen3_moe",
        2048,
        48,
        32,
        4,
        6144,
        151936,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    "qwen3-235b-a22b": _decoder(
        "qwen3_moe",
        4096,
        94,
        64,
        4,
        12288,
        151936,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=1536,
    ),
    # facebook/opt-{350m,1.3b,6.7b,13b,30b,66b} (DeepSpeed-Chat's models)
    "opt-350m": _opt(1024, 24, 16),
    "opt-1.3b": _opt(2048, 24, 32),
    "opt-6.7b": _opt(4096, 32, 32),
    "opt-13b": _opt(5120, 40, 40),
    "opt-30b": _opt(7168, 48, 56),
    "opt-66b": _opt(9216, 64, 72),
}


def model_config(name: str, tokenizer=None) -> object:
    """An architecture to plan with: a preset (:data:`MODEL_PRESETS`), an HF ``config.json`` file (read as it is:
    no weights, no network), a zoo model (``llama-1m``; its vocabulary from ``tokenizer``, by default the built-in one),
    a pretrained model (its converted checkpoint's ``config.json``) or a local HF checkpoint directory."""
    if name in MODEL_PRESETS:
        return MODEL_PRESETS[name]
    if name.endswith(".json"):
        return read_config_json(name)
    # the zoo and transformers are imported only for the names that need them: the planner prices presets and
    # config.json files without loading torch
    from loomrl.models.pretrained import PRETRAINED, pretrained_dir
    from loomrl.models.zoo import ZOO, zoo_config

    if name in ZOO:
        from loomrl.models.tokenizer import tokenizer_for

        return zoo_config(name, tokenizer or tokenizer_for(None))
    directory = pretrained_dir(name) if name in PRETRAINED else name
    if Path(directory, "config.json").is_file():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(directory)
    raise ConfigError(
        f"model: '{name}' is not a preset, a config.json, a zoo model, a pretrained model or a checkpoint "
        f"directory; presets: {', '.join(MODEL_PRESETS)}; zoo: {', '.join(ZOO)}; pretrained: {', '.join(PRETRAINED)}"
    )


def read_config_json(path: str) -> SimpleNamespace:
    """An HF ``config.json`` as attributes; one-line errors name the file and what is missing."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: cannot read a model config ({err})") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: a model config is a JSON object (an HF config.json)")
    config = SimpleNamespace(**data)
    try:
        ModelShape.from_config(config)
    except (AttributeError, TypeError, ValueError, ConfigError) as err:
        raise DataError(
            f"{path}: not a decoder config ({err}); needed: hidden_size, num_hidden_layers, "
            "num_attention_heads, vocab_size"
        ) from None
    return config
