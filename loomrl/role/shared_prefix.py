"""Shared prompts computed once: a group's samples run their common prompt through the model one time.

GRPO and RLOO draw several responses to each prompt, and a training or scoring pass over prompt + response
rows computes every prompt once per sample. Here the distinct prompts run once (with autograd, when the caller
trains), their keys and values are kept per layer, and the responses run as a second forward that attends to
their own prompt's keys and values before their own, at the positions they have in the full row. The outputs
are put together at the rows' full width, prompt positions taken from the prompt pass, so the caller sees what
one forward over the whole rows gives (the same arithmetic, in another order: equal up to rounding). The
backward reaches the prompt pass through the keys and values, as it would through the attention of one forward.

It applies to a plain Hugging Face decoder (a whole model on this process, a data-parallel replica or a
tensor-parallel shard holding the same rows); pipeline stages and FSDP passes, whose forwards are collective
or split by layer, run the whole rows, and so does a model recomputing its activations (transformers turns
caching off under gradient checkpointing). It is taken where it saves at least :data:`MIN_SAVING` of the
positions.

Legend: B = rows, U = distinct prompts, L = row width, P = longest distinct prompt, R = longest response part,
H = KV heads, D = head dim.
"""

from __future__ import annotations

import torch
from transformers import Cache, PreTrainedModel

from loomrl.models.heads import is_value_model, score_head

__all__ = ["MIN_SAVING", "prompt_groups", "shared_prefix_outputs"]

MIN_SAVING = 0.15
"""Fraction of a pass's positions sharing must save to be worth its second forward."""


def prompt_groups(ids_BL: torch.Tensor, prompt_len_B: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """(first row of each distinct prompt, each row's index among them), or None when sharing does not pay."""
    lengths = prompt_len_B.tolist()
    if not lengths or min(lengths) < 1:  # a row without a prompt has nothing to share
        return None
    rows = ids_BL[:, : max(lengths)].tolist()
    distinct: dict[tuple[int, ...], int] = {}
    firsts: list[int] = []
    index_B: list[int] = []
    for b, (row, n) in enumerate(zip(rows, lengths)):
        key = tuple(row[:n])
        if key not in distinct:
            distinct[key] = len(firsts)
            firsts.append(b)
        index_B.append(distinct[key])
    saved = sum(lengths) - sum(lengths[b] for b in firsts)
    total = int(ids_BL.shape[0] * ids_BL.shape[1])
    if not total or saved < MIN_SAVING * total:
        return None
    return firsts, index_B


class _PrefixKV(Cache):
    """Per-layer keys and values: collected from the prompt pass, then put before each response pass's own."""

    def __init__(self) -> None:
        super().__init__(layers=[])
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.rows_B: torch.Tensor | None = None
        """Set for the response pass: the distinct prompt of each row."""

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self.rows_B is None:
            self.keys.append(key_states)
            self.values.append(value_states)
            return key_states, value_states
        keys = torch.cat([self.keys[layer_idx].index_select(0, self.rows_B), key_states], dim=2)
        values = torch.cat([self.values[layer_idx].index_select(0, self.rows_B), value_states], dim=2)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.rows_B is None or not self.keys else int(self.keys[0].shape[2])


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A B×1×Q×K additive attention mask from a B×Q×K boolean one."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def shared_prefix_outputs(
    model: PreTrainedModel,
    ids_BL: torch.Tensor,
    attn_BL: torch.Tensor,
    prompt_len_B: torch.Tensor,
    groups: tuple[list[int], list[int]],
) -> torch.Tensor:
    """What :func:`~loomrl.models.heads.model_outputs` gives for these right-padded rows (logits_BLV, or
    values_BL for a value model), each distinct prompt of ``groups`` (:func:`prompt_groups`) run once."""
    firsts, index_B = groups
    device = ids_BL.device
    dtype = model.dtype
    plen_U = prompt_len_B[firsts]
    width_P = int(plen_U.max())
    ids_UP = ids_BL[firsts, :width_P]
    pos_P = torch.arange(width_P, device=device)
    real_UP = pos_P[None, :] < plen_U[:, None]
    causal_PP = pos_P[None, :] <= pos_P[:, None]
    cache = _PrefixKV()
    prompt_UPX = _run(
        model,
        ids_UP * real_UP,
        _additive(causal_PP[None] & real_UP[:, None, :], dtype),
        pos_P.expand(len(firsts), width_P),
        cache,
    )

    # the response parts, each row's tokens after its prompt, at their positions in the full row
    plen_B = prompt_len_B
    end_B = (attn_BL * torch.arange(1, ids_BL.shape[1] + 1, device=device)).amax(1)
    width_R = max(int((end_B - plen_B).max()), 1)
    pos_BR = plen_B[:, None] + torch.arange(width_R, device=device)[None, :]
    real_BR = pos_BR < end_B[:, None]
    ids_BR = ids_BL.gather(1, pos_BR.clamp(max=ids_BL.shape[1] - 1)) * real_BR
    rows_B = torch.tensor(index_B, device=device)
    cache.rows_B = rows_B
    sees_prompt_BRP = (pos_P[None, None, :] < plen_B[:, None, None]).expand(-1, width_R, -1)
    r = torch.arange(width_R, device=device)
    sees_response_BRR = (r[None, :] <= r[:, None])[None] & real_BR[:, None, :]
    mask = _additive(torch.cat([sees_prompt_BRP, sees_response_BRR], dim=2), dtype)
    response_BRX = _run(model, ids_BR, mask, pos_BR, cache)

    # put together at the full width: prompt positions from the prompt pass, the rest from the response pass
    width = ids_BL.shape[1]
    pos_L = torch.arange(width, device=device)
    from_prompt_BL = pos_L[None, :] < plen_B[:, None]
    prompt_BLX = prompt_UPX.index_select(0, rows_B)[:, pos_L.clamp(max=width_P - 1)]
    response_BLX = response_BRX.gather(
        1, _expand((pos_L[None, :] - plen_B[:, None]).clamp(0, width_R - 1), response_BRX)
    )
    return torch.where(_expand(from_prompt_BL, prompt_BLX), prompt_BLX, response_BLX)


def _expand(index_BL: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A B×L index or condition broadcast over the trailing dims of ``like`` (B×L or B×L×V)."""
    if like.dim() == 2:
        return index_BL
    return index_BL[:, :, None].expand(-1, -1, like.shape[2])


def _run(
    model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: _PrefixKV
) -> torch.Tensor:
    """One forward with the given 4-D mask, positions and cache: logits, or per-position values."""
    if is_value_model(model):
        out = model.base_model(
            input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True
        )
        head = score_head(model)
        return head(out.last_hidden_state.to(head.weight.dtype)).squeeze(-1).float()
    return model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True).logits
