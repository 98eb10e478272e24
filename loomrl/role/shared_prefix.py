"""Shared prompts computed once: a group's samples run their common prompt through the model one time.

GRPO and RLOO draw several responses to each prompt, and a training or scoring pass over prompt + response
rows computes every prompt once per sample. Here the distinct prompts run once (with autograd, when the caller
trains), their keys and values are kept per layer, and the responses run as a second forward that attends to
their own prompt's keys and values before their own, at the positions they have in the full row. The outputs
are the response columns a loss reads (:func:`~loomrl.models.heads.response_outputs`), the last prompt position's
taken from the prompt pass: what one forward over the whole rows gives there (the same arithmetic, in another
order: equal up to rounding). The backward reaches the prompt pass through the keys and values, as it would
through the attention of one forward.

It applies to a plain Hugging Face decoder (a whole model on this process, a data-parallel replica or a
tensor-parallel shard holding the same rows); pipeline stages and FSDP passes, whose forwards are collective
or split by layer, run the whole rows, and so does a model recomputing its activations (transformers turns
caching off under gradient checkpointing), and so does a model whose outputs are more than its head on its
backbone (:func:`~loomrl.models.heads.applies_head_alone`). It is taken where it saves at least
:data:`MIN_SAVING` of the positions.

Legend: B = rows, U = distinct prompts, L = row width, P = longest distinct prompt, R = longest response part,
H = KV heads, D = head dim.
"""

from __future__ import annotations

import torch
from transformers import Cache, PreTrainedModel

from loomrl.models.heads import head_at_responses
from loomrl.workflow.batch import row_ends

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
    width: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """What :func:`~loomrl.models.heads.response_outputs` gives for these right-padded rows (a policy's log-probs
    and entropies, or values, at ``width`` response columns), each distinct prompt of ``groups``
    (:func:`prompt_groups`) run once.

    Column 0 (the last prompt position, scoring the first response token) comes from the prompt pass, the
    others from the response pass; the head runs on those columns only. A response's last token scores
    nothing a loss reads and no later token attends to it, so the response pass stops before it."""
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
    prompt_UPH = _hidden(
        model,
        ids_UP * real_UP,
        _additive(causal_PP[None] & real_UP[:, None, :], dtype),
        pos_P.expand(len(firsts), width_P),
        cache,
    )
    rows_B = torch.tensor(index_B, device=device)
    last_BH = prompt_UPH[torch.arange(len(firsts), device=device), plen_U - 1].index_select(0, rows_B)
    if width == 1:
        return head_at_responses(model, last_BH[:, None], ids_BL, attn_BL, prompt_len_B, temperature)

    # the response parts but their last token, each row's tokens after its prompt, at their positions in the row
    plen_B = prompt_len_B
    end_B = row_ends(attn_BL)
    width_R = width - 1
    pos_BR = plen_B[:, None] + torch.arange(width_R, device=device)[None, :]
    real_BR = pos_BR < end_B[:, None]
    ids_BR = ids_BL.gather(1, pos_BR.clamp(max=ids_BL.shape[1] - 1)) * real_BR
    cache.rows_B = rows_B
    sees_prompt_BRP = (pos_P[None, None, :] < plen_B[:, None, None]).expand(-1, width_R, -1)
    r = torch.arange(width_R, device=device)
    sees_response_BRR = (r[None, :] <= r[:, None])[None] & real_BR[:, None, :]
    mask = _additive(torch.cat([sees_prompt_BRP, sees_response_BRR], dim=2), dtype)
    response_BRH = _hidden(model, ids_BR, mask, pos_BR, cache)
    hidden_BRH = torch.cat([last_BH[:, None], response_BRH], dim=1)
    return head_at_responses(model, hidden_BRH, ids_BL, attn_BL, prompt_len_B, temperature)


def _hidden(
    model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: _PrefixKV
) -> torch.Tensor:
    """The backbone's last hidden states of one forward with the given 4-D mask, positions and cache."""
    out = model.base_model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    return out.last_hidden_state
