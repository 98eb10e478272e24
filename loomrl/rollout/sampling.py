"""Token sampling whose randomness belongs to the sample, not to the batch.

Every sample owns a random stream keyed by (seed, iteration, sample id). The noise for step ``t`` of a sample is
a pure function of (key, t, vocabulary index), computed with a counter-based hash on the device itself, so the
token drawn does not depend on batch composition, slot order, device or how many samples were drawn before
it. Sampling is Gumbel-max over the filtered, temperature-scaled logits, which draws exactly from their softmax.

On a CPU the noise is hashed and maximised a block of vocabulary columns at a time: a hash is a dozen integer
passes, and over a whole B×V block (50 MB at 128 rows of a 49k vocabulary) each pass goes to memory, which made
token choice cost twice what ``torch.multinomial`` does. Blocks that stay in a core's cache give the same tokens
(the first maximum wins across blocks as within one) at a fifth of the time.

Legend: B = samples in the batch, V = vocabulary.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# splitmix64 constants written as signed int64 (torch has no uint64 arithmetic on every device).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MUL1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MUL2 = 0x94D049BB133111EB - (1 << 64)
_VOCAB_STRIDE = 0xD6E8FEB86659FD93 - (1 << 64)

_BLOCK_ELEMENTS = 1 << 19
"""Elements of one block of noise on a CPU (4 MiB of int64 per temporary: a core's cache, not memory)."""


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn. ``temperature == 0`` means greedy decoding."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    """Tokens besides eos that end a sample (kept as its last token, like eos)."""
    ignore_eos: bool = False
    """Decode every sample to its token budget, eos or not (serving benchmarks' setting, for set lengths)."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def stream_keys(
    seed: int, iteration: int, sample_ids: Sequence[int], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """One 63-bit stream key per sample, from a stable hash of (seed, iteration, sample id)."""
    keys = []
    for sid in sample_ids:
        digest = hashlib.blake2b(f"{seed}/{iteration}/{sid}".encode(), digest_size=8).digest()
        keys.append(int.from_bytes(digest, "little") >> 1)
    return torch.tensor(keys, dtype=torch.int64, device=device)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on negative values)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser; int64 multiplication wraps modulo 2**64 on CPU and CUDA alike."""
    x = x ^ _shr(x, 30)
    x = x * _MUL1
    x = x ^ _shr(x, 27)
    x = x * _MUL2
    return x ^ _shr(x, 31)


def _per_step(keys_B: torch.Tensor, steps_B: torch.Tensor) -> torch.Tensor:
    return _mix64(keys_B + (steps_B.to(torch.int64) + 1) * _GOLDEN)


def uniform_noise(keys_B: torch.Tensor, steps_B: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms in (0, 1), shape B×V, a pure function of (key, step, vocabulary index)."""
    return _noise_columns(_per_step(keys_B, steps_B), 0, vocab)


def _noise_columns(per_step_B: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Columns ``start:stop`` of :func:`uniform_noise`, from each row's per-step hash."""
    v_V = torch.arange(start, stop, device=per_step_B.device, dtype=torch.int64)
    bits_BV = _mix64(per_step_B[:, None] ^ (v_V[None, :] * _VOCAB_STRIDE))
    # 23 high bits: (k + 0.5) / 2**23 is exact in float32 and stays strictly inside (0, 1); with 24 bits the
    # largest value rounds to 1.0 and its Gumbel noise would be +inf.
    top23_BV = _shr(bits_BV, 41)
    return (top23_BV.to(torch.float32) + 0.5) / float(1 << 23)


def filter_logits(logits_BV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) every token outside the top-k and outside the top-p nucleus."""
    if top_k and top_k < logits_BV.shape[-1]:
        kth_B1 = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if top_p < 1.0:
        sorted_BV, order_BV = torch.sort(logits_BV, dim=-1, descending=True)
        cum_BV = torch.softmax(sorted_BV, dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the most likely token always stays.
        drop_sorted_BV = (cum_BV - torch.softmax(sorted_BV, dim=-1)) >= top_p
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
        logits_BV = logits_BV.masked_fill(drop_BV, float("-inf"))
    return logits_BV


def sample_tokens(
    logits_BV: torch.Tensor, keys_B: torch.Tensor, steps_B: torch.Tensor, params: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return (token_B, logp_B) under the distribution actually sampled from.

    Greedy decoding reports the log-prob of the chosen token under the unscaled softmax.
    """
    logits_BV = logits_BV.float()
    if params.greedy:
        logp_BV = torch.log_softmax(logits_BV, dim=-1)
        tok_B = logits_BV.argmax(dim=-1)
        return tok_B, logp_BV.gather(-1, tok_B[:, None]).squeeze(-1)
    if params.temperature != 1.0:  # a pass over B×V saved at the common setting
        logits_BV = logits_BV / params.temperature
    scaled_BV = filter_logits(logits_BV, params.top_k, params.top_p)
    logp_BV = torch.log_softmax(scaled_BV, dim=-1)
    tok_B = _gumbel_argmax(logp_BV, _per_step(keys_B, steps_B))
    return tok_B, logp_BV.gather(-1, tok_B[:, None]).squeeze(-1)


def _gumbel_argmax(logp_BV: torch.Tensor, per_step_B: torch.Tensor) -> torch.Tensor:
    """argmax over the vocabulary of logp + Gumbel noise, a block of columns at a time off CUDA (see the module
    docstring); the first maximum wins, as ``argmax`` over the whole row picks it."""
    rows, vocab = logp_BV.shape
    block = vocab if logp_BV.device.type == "cuda" else max(1, _BLOCK_ELEMENTS // max(rows, 1))
    best_B = tok_B = None
    for start in range(0, vocab, block):
        stop = min(start + block, vocab)
        u_BV = _noise_columns(per_step_B, start, stop)
        value_B, index_B = (logp_BV[:, start:stop] - torch.log(-torch.log(u_BV))).max(dim=-1)
        if best_B is None:
            best_B, tok_B = value_B, index_B
        else:
            better_B = value_B > best_B
            best_B = torch.where(better_B, value_B, best_B)
            tok_B = torch.where(better_B, index_B + start, tok_B)
    return tok_B
