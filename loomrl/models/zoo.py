"""A zoo of tiny Hugging Face architectures, randomly initialised, and loaders for local checkpoints.

A model is named by a zoo name (``llama-1m``) — a config of a real HF architecture whose vocabulary comes from
the tokenizer, built with random weights drawn from an explicit seed —, by a pretrained name
(``smollm2-135m-instruct``, :mod:`loomrl.models.pretrained`: a checkpoint directory converted once from a file an
installed package ships), or by a local directory holding an HF checkpoint. Nothing is ever downloaded. Because
every model is a stock transformers class, checkpoints written here load with plain transformers.

Choices that hold for every zoo model:
- attention is ``eager``: ``sdpa`` runs on CPU but differs from eager by ~5e-7 in the logits, and the
  rollout/training log-prob comparisons are easier to test when the reference implementation is used;
- dropout is 0 (GPT-2 defaults to 0.1): RL compares log-probs of the same tokens under the same weights,
  which dropout would make noisy;
- input and output embeddings are untied, so the zoo and the value models have the same parameter layout;
- models are returned in eval mode, as ``from_pretrained`` does; trainers call ``.train()`` themselves.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from loomrl.errors import DataError
from loomrl.models.heads import score_head, tied_embeddings
from loomrl.models.lora import add_adapters, moving_parameters
from loomrl.models.pretrained import PRETRAINED, pretrained_dir

if TYPE_CHECKING:
    from loomrl.config.schema import LoraConfig

ATTN_IMPLEMENTATION = "eager"
"""Attention kernel of every model built or loaded here (see the module docstring for why)."""

MAX_POSITIONS = 256
"""Longest sequence (prompt + response, in tokens) a zoo model accepts."""

_LLAMA_LIKE = {"rms_norm_eps": 1e-5, "attention_dropout": 0.0}

ZOO: dict[str, dict[str, Any]] = {
    # ~1.0M parameters with the 48-token task vocabulary; GQA (4 query heads share 2 key/value heads).
    "llama-1m": {
        "model_type": "llama",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        **_LLAMA_LIKE,
    },
    # ~9.9M parameters.
    "llama-10m": {
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 10,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 1024,
        **_LLAMA_LIKE,
    },
    # ~29.6M parameters.
    "llama-30m": {
        "model_type": "llama",
        "hidden_size": 512,
        "num_hidden_layers": 10,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 1408,
        **_LLAMA_LIKE,
    },
    # ~1.0M parameters; Qwen2 differs from Llama by biases on the q/k/v projections.
    "qwen2-1m": {
        "model_type": "qwen2",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        **_LLAMA_LIKE,
    },
    # ~0.84M parameters; learned absolute positions, LayerNorm, GELU MLP of width 4×128.
    "gpt2-1m": {
        "model_type": "gpt2",
        "n_embd": 128,
        "n_layer": 4,
        "n_head": 4,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "summary_first_dropout": 0.0,
    },
}
"""Zoo name → HF config fields (``model_type`` picks the architecture)."""

MODEL_NAMES: tuple[str, ...] = tuple(ZOO)

# Config fields that must agree for one checkpoint's weights to fit another model's shapes.
_SHAPE_FIELDS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
)


def zoo_config(name: str, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """The HF config of zoo model ``name`` with vocabulary and special-token ids taken from ``tokenizer``."""
    if name not in ZOO:
        raise _unknown_model(name)
    fields = dict(ZOO[name])
    model_type = fields.pop("model_type")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
        **fields,
    )
    # Set after construction: GPT-2 calls it n_positions and maps the standard name through attribute_map.
    config.max_position_embeddings = MAX_POSITIONS
    return config


def _unknown_model(name_or_path: str) -> DataError:
    return DataError(
        f"model '{name_or_path}': not a zoo name ({', '.join(MODEL_NAMES)}), a pretrained name "
        f"({', '.join(PRETRAINED)}) nor a local checkpoint directory"
    )


def checkpoint_dir(name_or_path: str) -> str | None:
    """The checkpoint directory a model spec stands for: a pretrained name's converted directory (converted on first
    use), a directory with a ``config.json`` itself; None for a zoo name (random weights) or anything else."""
    if name_or_path in PRETRAINED:
        return pretrained_dir(name_or_path)
    return name_or_path if _is_checkpoint_dir(name_or_path) else None


def parameter_shapes(
    name_or_path: str, tokenizer: PreTrainedTokenizerBase, value: bool, lora: LoraConfig | None = None
) -> tuple[dict[str, tuple[int, ...]], int, bool]:
    """Names and full shapes of the parameters a role moves, its layer count and whether its output head shares
    its input embedding (:func:`loomrl.models.heads.tied_embeddings`), of a zoo or checkpoint model,
    without building its weights: the model is instantiated from its config on the meta device. With ``lora``,
    only the adapters (and a value head) move (:func:`loomrl.models.lora.is_moving`)."""
    if name_or_path in ZOO:
        config = zoo_config(name_or_path, tokenizer)
    elif (directory := checkpoint_dir(name_or_path)) is not None:
        config = AutoConfig.from_pretrained(directory)
    else:
        raise _unknown_model(name_or_path)
    auto = AutoModelForSequenceClassification if value else AutoModelForCausalLM
    if value:
        config.num_labels = 1
    with torch.device("meta"):
        model = auto.from_config(config, attn_implementation=ATTN_IMPLEMENTATION)
    if lora is not None:
        add_adapters(model, lora, 0)
    return {n: tuple(p.shape) for n, p in moving_parameters(model)}, config.num_hidden_layers, tied_embeddings(model)


def check_model_spec(name_or_path: str) -> None:
    """Raise the one-line DataError for a spec that is neither a zoo name nor a checkpoint directory with
    weights."""
    if name_or_path in ZOO:
        return
    directory = checkpoint_dir(name_or_path)
    if directory is None:
        raise _unknown_model(name_or_path)
    if not any(os.path.isfile(os.path.join(directory, f)) for f in _WEIGHT_FILES):
        # e.g. a role directory of a run's sharded checkpoint, which holds shards, not a Hugging Face model
        raise DataError(
            f"model '{name_or_path}': config.json but no weights ({', '.join(_WEIGHT_FILES)}); for a "
            "run's checkpoint write the role's Hugging Face form first (loomrl export CHECKPOINT "
            "--role ROLE) and give that directory"
        )


_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
"""The files ``from_pretrained`` takes weights from."""


def _is_checkpoint_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def _check_vocab(path: str, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """A checkpoint whose embedding table is smaller than the tokenizer would index out of range."""
    if config.vocab_size < len(tokenizer):
        raise DataError(
            f"model '{path}': vocab_size {config.vocab_size} is smaller than the tokenizer's "
            f"{len(tokenizer)} tokens (use the tokenizer saved with the checkpoint)"
        )


def build_causal_lm(
    name_or_path: str, tokenizer: PreTrainedTokenizerBase, seed: int, dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """A causal LM: a zoo name gives random weights drawn from ``seed``; a local directory is loaded."""
    if name_or_path in ZOO:
        config = zoo_config(name_or_path, tokenizer)
        # fork_rng: seeding must not disturb the caller's global RNG stream.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
        return model.eval()
    directory = checkpoint_dir(name_or_path)
    if directory is None:
        raise _unknown_model(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, local_files_only=True, attn_implementation=ATTN_IMPLEMENTATION
    )
    _check_vocab(name_or_path, model.config, tokenizer)
    return model.eval()


def build_value_model(
    name_or_path: str,
    tokenizer: PreTrainedTokenizerBase,
    seed: int,
    init_from: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """A scalar-output ``AutoModelForSequenceClassification`` (num_labels=1): a critic or a reward model.

    ``name_or_path`` gives the architecture (and the weights, if it is a directory); ``init_from``, a local
    checkpoint directory of the same architecture, overrides the weights — typically the SFT policy, whose
    backbone then initialises the critic. A causal-LM checkpoint contributes its backbone only.

    A score head that the weights do not provide is initialised to ZERO: an untrained critic then predicts
    V=0 everywhere (no random-feature noise in the first advantages) and an untrained reward model scores
    every pair as a tie (Bradley–Terry loss exactly log 2). Learning still starts at once, because the
    head's gradient (the hidden state) is non-zero; the backbone receives gradient from the second step.
    """
    source = init_from if init_from is not None else name_or_path
    if name_or_path not in ZOO and checkpoint_dir(name_or_path) is None:
        raise _unknown_model(name_or_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if source in ZOO:
            config = zoo_config(source, tokenizer)
            config.num_labels = 1
            model = AutoModelForSequenceClassification.from_config(
                config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
            )
            head_is_fresh = True
        else:
            model, head_is_fresh = _load_value_checkpoint(
                source, pad_id, dtype, "init_from" if init_from is not None else "model"
            )
    if init_from is not None:
        _check_same_shapes(name_or_path, init_from, tokenizer, model.config)
    _check_vocab(source, model.config, tokenizer)
    if head_is_fresh:
        with torch.no_grad():
            head = score_head(model)
            head.weight.zero_()
            if head.bias is not None:
                head.bias.zero_()
    return model.eval()


def _load_value_checkpoint(
    path: str, pad_id: int | None, dtype: torch.dtype, field: str
) -> tuple[PreTrainedModel, bool]:
    """Load a sequence-classification model from ``path``; also say whether its score head was missing."""
    directory = checkpoint_dir(path)
    if directory is None:
        raise DataError(f"{field} '{path}': not a local checkpoint directory (no config.json) nor a pretrained name")
    model, info = AutoModelForSequenceClassification.from_pretrained(
        directory,
        num_labels=1,
        pad_token_id=pad_id,
        dtype=dtype,
        local_files_only=True,
        attn_implementation=ATTN_IMPLEMENTATION,
        output_loading_info=True,
    )
    head_names = {n for n, _ in model.named_parameters() if n.split(".")[0] in ("score", "classifier")}
    head_is_fresh = bool(head_names & set(info["missing_keys"]))
    return model, head_is_fresh


def _check_same_shapes(
    name_or_path: str, init_from: str, tokenizer: PreTrainedTokenizerBase, loaded: PretrainedConfig
) -> None:
    """``init_from`` must have the architecture that ``name_or_path`` names, or the config would lie."""
    directory = checkpoint_dir(name_or_path)
    if directory is None:
        wanted = zoo_config(name_or_path, tokenizer)
    else:
        wanted = AutoConfig.from_pretrained(directory, local_files_only=True)
    want = {f: getattr(wanted, f, None) for f in _SHAPE_FIELDS}
    got = {f: getattr(loaded, f, None) for f in _SHAPE_FIELDS}
    diff = [f"{f}={got[f]} (expected {want[f]})" for f in _SHAPE_FIELDS if want[f] != got[f]]
    if diff:
        raise DataError(
            f"init_from '{init_from}': architecture differs from model '{name_or_path}': " + ", ".join(diff)
        )


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied ones counted once); works on meta-device models too."""
    return sum(p.numel() for p in model.parameters())
