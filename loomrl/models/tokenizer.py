"""A character-level tokenizer for the synthetic tasks, built offline with the `tokenizers` library.

Every character of :data:`TASK_ALPHABET` is one token, so a 1M-parameter model sees digits as digits and
never has to learn a BPE segmentation. The tokenizer is an ordinary ``PreTrainedTokenizerFast``: it saves
with ``save_pretrained`` and loads back with ``AutoTokenizer`` without network access.

Special tokens take ids 0–3 (pad, bos, eos, unk). Encoding adds no bos/eos: callers add them explicitly,
so the token layout of prompts and responses is decided in one place (the rollout code), not here.
"""

from __future__ import annotations

import os
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from loomrl.errors import DataError

TASK_ALPHABET: str = string.digits + string.ascii_lowercase + " +=:>,-|"
"""Every character the built-in tasks use in prompts and answers."""

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
"""Special tokens in id order: pad=0, bos=1, eos=2, unk=3."""


def build_char_tokenizer(alphabet: str = TASK_ALPHABET) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: ids 0–3 are pad/bos/eos/unk, then one id per alphabet character."""
    chars = list(alphabet)
    if not chars or len(set(chars)) != len(chars):
        # A repeated character would silently give two ids for one token and a vocab with holes.
        raise DataError(f"tokenizer alphabet {alphabet!r}: must be non-empty with no repeated characters")
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Isolating each character (spaces included) is what makes " " a token rather than a separator.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    # Fuse joins tokens with no separator, so decode(encode(s)) == s even for strings with spaces.
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="right",
    )


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Load a tokenizer saved with ``save_pretrained`` from a local directory, never from the network."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise DataError(f"tokenizer path '{path}': not a local directory (save one with save_pretrained)")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"tokenizer path '{path}': cannot be loaded ({first})") from exc


def tokenizer_for(model: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer saved with a checkpoint directory, else the built-in task alphabet tokenizer."""
    if model and Path(model).is_dir() and (Path(model) / "tokenizer_config.json").exists():
        return load_tokenizer(model)
    return build_char_tokenizer()


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """A prompt's token ids: the tokenizer's bos, then the text's tokens."""
    return [tokenizer.bos_token_id, *tokenizer.encode(text, add_special_tokens=False)]


def decode_response(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """Text of a response up to (not including) its eos."""
    eos = tokenizer.eos_token_id
    if eos in ids:
        ids = ids[: ids.index(eos)]
    return tokenizer.decode(ids, skip_special_tokens=True).strip()
