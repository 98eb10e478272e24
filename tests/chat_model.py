"""A tiny chat model as a user would bring one: a Qwen2-architecture checkpoint whose tokenizer is a real byte-level
BPE (trained here, offline, with `tokenizers`) with a ChatML chat template, no bos token, ``<|im_end|>`` as eos
and ``<|endoftext|>`` as pad, as Qwen2's own tokenizer has them.

The BPE is trained on the digit-sorting task written in ChatML, so prompts are a handful of merged tokens rather
than one token per character; the model's weights are random (the zoo's ``qwen2-1m`` drawn for this vocabulary).
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from loomrl.data.tasks import SortDigits
from loomrl.models.zoo import build_causal_lm

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""The ChatML template of Qwen2's tokenizer, without its default system prompt."""

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _corpus(n: int = 3000, seed: int = 0) -> list[str]:
    rng, task = random.Random(seed), SortDigits(min_len=2, max_len=6)
    rows = []
    for _ in range(n):
        ex = task.sample(rng)
        rows.append(
            f"<|im_start|>system\nYou sort digits.<|im_end|>\n<|im_start|>user\n{ex.prompt}<|im_end|>\n"
            f"<|im_start|>assistant\n{ex.answer}<|im_end|>\n"
        )
    return rows


def build_chat_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE with the ChatML template: no bos, eos ``<|im_end|>``, pad ``<|endoftext|>``."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
        padding_side="right",
    )


def save_chat_model(path: Path, seed: int = 0) -> Path:
    """Write the tiny Qwen2 chat checkpoint (model + tokenizer) to ``path``; returns it."""
    tokenizer = build_chat_tokenizer()
    model = build_causal_lm("qwen2-1m", tokenizer, seed)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
