"""Batched KV-cached generation with per-sample random streams.

This is the reference generator: a static batch whose finished rows are dropped from the KV cache (so the tail
does not pay for finished samples). Continuous batching, streaming and abort/resubmit belong to the rollout
engine; both produce identical tokens for a sample because the noise comes from the sample's own stream.

Legend: B = rows still decoding, P = longest prompt, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from loomrl.rollout.sampling import SamplingParams, sample_tokens


@dataclass
class Generation:
    """One finished sample: generated token ids (eos included when emitted) and their log-probs."""

    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids_BP = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask_BP = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids_BP[b, width - len(p):] = torch.tensor(list(p), dtype=torch.long, device=device)
        mask_BP[b, width - len(p):] = 1
    return ids_BP, mask_BP


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    keys_B: torch.Tensor,
    params: SamplingParams,
    eos_id: int,
    pad_id: int,
) -> list[Generation]:
    """Sample a response for every prompt; row ``b`` draws its noise from stream ``keys_B[b]``."""
    device = next(model.parameters()).device
    ids_BP, mask_BP = _left_pad(prompts, pad_id, device)
    pos_BP = (mask_BP.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(input_ids=ids_BP, attention_mask=mask_BP, position_ids=pos_BP, past_key_values=cache, use_cache=True)
    logits_BV = out.logits[:, -1, :]
    results = [Generation() for _ in prompts]
    alive = list(range(len(prompts)))  # original index of each live row
    keys_B = keys_B.to(device)
    next_pos_B = pos_BP[:, -1] + 1
    for step in range(params.max_new_tokens):
        steps_B = torch.full((len(alive),), step, dtype=torch.int64, device=device)
        tok_B, logp_B = sample_tokens(logits_BV, keys_B, steps_B, params)
        keep = []
        for row, (orig, tok, lp) in enumerate(zip(alive, tok_B.tolist(), logp_B.tolist())):
            results[orig].tokens.append(tok)
            results[orig].logps.append(lp)
            if tok != eos_id and step + 1 < params.max_new_tokens:
                keep.append(row)
        if not keep:
            break
        if len(keep) < len(alive):
            sel = torch.tensor(keep, device=device)
            cache.batch_select_indices(sel)
            tok_B, mask_BP, keys_B, next_pos_B = tok_B[sel], mask_BP[sel], keys_B[sel], next_pos_B[sel]
            alive = [alive[r] for r in keep]
        mask_BP = torch.cat([mask_BP, mask_BP.new_ones((len(alive), 1))], dim=-1)
        out = model(
            input_ids=tok_B[:, None],
            attention_mask=mask_BP,
            position_ids=next_pos_B[:, None],
            past_key_values=cache,
            use_cache=True,
        )
        logits_BV = out.logits[:, -1, :]
        next_pos_B = next_pos_B + 1
    return results
