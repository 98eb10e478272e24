"""Tokenizers of a run and the one rule that turns a prompt into token ids.

- The built-in character-level tokenizer for the synthetic tasks, built offline with the `tokenizers` library:
  every character of :data:`TASK_ALPHABET` is one token, so a 1M-parameter model sees digits as digits and never
  has to learn a BPE segmentation. Special tokens take ids 0–3 (pad, bos, eos, unk). It is an ordinary
  ``PreTrainedTokenizerFast``: it saves with ``save_pretrained`` and loads back with ``AutoTokenizer`` offline.
- :func:`tokenizer_for`: the tokenizer of a run's model (the one saved with a checkpoint, the built-in one for a
  zoo model or when asked for, or another saved one), with its chat template kept, dropped or replaced.
- :func:`encode_prompt`: a prompt's ids. With a chat template, the template rendered with the generation prompt
  (a plain prompt becomes one user message); without one, bos (when the tokenizer has one: Qwen2's has not) and
  the text. Every caller (rollouts, evaluation, SFT, reward models) encodes prompts here, so the layout of a
  prompt is decided in one place; responses are the answer's tokens and eos, added by the callers.
"""

from __future__ import annotations

import os
import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from loomrl.errors import DataError
from loomrl.models.pretrained import is_pretrained, pretrained_dir

if TYPE_CHECKING:  # a type only: the models know nothing of the run's config
    from loomrl.config.schema import TaskConfig

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


TOKENIZER_FILES: tuple[str, ...] = ("tokenizer_config.json", "tokenizer.json")
"""Files ``save_pretrained`` writes for a tokenizer; a checkpoint directory holding neither has none."""

CHAT_TEMPLATE_MODES: tuple[str, ...] = ("auto", "none")
"""``task.chat_template`` values besides the path of a Jinja template file."""

Message = Mapping[str, str]
"""One turn of a conversation: ``{"role": "user" | "assistant" | "system", "content": text}``."""


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Load a tokenizer saved with ``save_pretrained`` from a local directory, never from the network.

    A tokenizer without a pad token (Llama 3's, for one) pads with its eos: padding is masked everywhere, and
    every batch the runtime builds needs some id to pad with.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise DataError(f"tokenizer path '{path}': not a local directory (save one with save_pretrained)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"tokenizer path '{path}': cannot be loaded ({first})") from exc
    if tokenizer.eos_token_id is None:
        raise DataError(
            f"tokenizer path '{path}': has no eos token (responses end at eos; set eos_token in its "
            "tokenizer_config.json)"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenizer_for(model: str | None, tokenizer: str = "auto", chat_template: str = "auto") -> PreTrainedTokenizerBase:
    """The tokenizer of a run whose policy is ``model`` (a zoo name or a checkpoint directory).

    ``tokenizer`` (``task.tokenizer``): 'auto' is the tokenizer saved with a checkpoint directory, and the
    built-in task tokenizer for a zoo model; a checkpoint directory without one is an error rather than a silent
    switch to 48 characters. 'task' is the built-in tokenizer whatever the model; anything else is the directory
    of a saved tokenizer. ``chat_template`` (``task.chat_template``): 'auto' keeps the tokenizer's template (if
    any), 'none' drops it, anything else is a Jinja template file that replaces it.
    """
    if tokenizer == "task":
        tok = build_char_tokenizer()
    elif tokenizer != "auto":
        try:
            tok = load_tokenizer(tokenizer)
        except DataError as err:
            raise DataError(f"task.tokenizer: {err}") from None
    elif model and (directory := _model_dir(model)) is not None:
        if not any((Path(directory) / name).is_file() for name in TOKENIZER_FILES):
            raise DataError(
                f"model '{model}': the checkpoint has no tokenizer ({' or '.join(TOKENIZER_FILES)} "
                "missing); save its tokenizer there, point task.tokenizer at one, or set "
                "task.tokenizer=task for the built-in task tokenizer"
            )
        tok = load_tokenizer(directory)
    else:
        tok = build_char_tokenizer()
    return with_chat_template(tok, chat_template)


def _model_dir(model: str) -> str | None:
    """The directory a model spec's tokenizer is saved in: a pretrained name's converted checkpoint, a directory
    itself; None for a zoo name."""
    if is_pretrained(model):
        return pretrained_dir(model)
    return model if os.path.isdir(model) else None


def task_tokenizer(task: TaskConfig, model: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer of a run whose policy is ``model``, as its ``task.tokenizer`` and ``task.chat_template``
    say (every process of a run builds its tokenizer here, from the same settings)."""
    return tokenizer_for(model, task.tokenizer, task.chat_template)


def with_chat_template(tokenizer: PreTrainedTokenizerBase, chat_template: str) -> PreTrainedTokenizerBase:
    """``tokenizer`` with its chat template kept ('auto'), dropped ('none') or read from a Jinja file."""
    if chat_template == "none":
        tokenizer.chat_template = None
    elif chat_template != "auto":
        if not os.path.isfile(chat_template):
            raise DataError(
                f"task.chat_template: '{chat_template}' is neither {' nor '.join(CHAT_TEMPLATE_MODES)} "
                "nor a Jinja template file"
            )
        tokenizer.chat_template = Path(chat_template).read_text(encoding="utf-8")
    return tokenizer


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | Sequence[Message]) -> list[int]:
    """A prompt's token ids: its chat template rendered with the generation prompt when the tokenizer has one
    (a plain prompt is one user message), else bos (if the tokenizer has one) and the text's tokens.

    ``prompt`` is text, or a conversation so far (``[{"role": ..., "content": ...}, ...]``), which needs a
    chat template. The rendered template is tokenized without adding special tokens: templates that want a bos
    write it themselves (Llama 3's), and those that do not must not get one (Qwen2's).
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
    elif isinstance(prompt, str):
        bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        ids = [*bos, *tokenizer.encode(prompt, add_special_tokens=False)]
    else:
        raise DataError(
            "a chat prompt (a list of messages) needs a tokenizer with a chat template; this one has "
            "none (set task.chat_template to a Jinja template file)"
        )
    if not ids:
        raise DataError(f"prompt {prompt!r} encodes to no tokens (the tokenizer has no bos to start it with)")
    return ids


def decode_response(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """Text of a response up to (not including) its eos."""
    eos = tokenizer.eos_token_id
    if eos in ids:
        ids = ids[: ids.index(eos)]
    return tokenizer.decode(ids, skip_special_tokens=True).strip()
