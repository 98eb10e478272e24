"""loomrl.models: tokenizers, a zoo of tiny HF architectures, and per-token heads over HF models.

Plain single-process PyTorch: parallelism is applied to these models from ``loomrl.parallel``, never here.
"""

from loomrl.models.heads import (
    last_real_index,
    score_head,
    sequence_scores,
    token_logprobs,
    token_logprobs_and_entropy,
    token_values,
)
from loomrl.models.tokenizer import SPECIAL_TOKENS, TASK_ALPHABET, build_char_tokenizer, load_tokenizer
from loomrl.models.zoo import (
    ATTN_IMPLEMENTATION,
    MAX_POSITIONS,
    MODEL_NAMES,
    ZOO,
    build_causal_lm,
    build_value_model,
    count_parameters,
    zoo_config,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "MAX_POSITIONS",
    "MODEL_NAMES",
    "SPECIAL_TOKENS",
    "TASK_ALPHABET",
    "ZOO",
    "build_causal_lm",
    "build_char_tokenizer",
    "build_value_model",
    "count_parameters",
    "last_real_index",
    "load_tokenizer",
    "score_head",
    "sequence_scores",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "token_values",
    "zoo_config",
]
