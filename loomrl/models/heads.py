"""Per-token quantities read off Hugging Face models: next-token log-probs, entropies, values, scores.

Pure functions of (model, batch): no distribution, no optimiser, no state. They are what the RL losses
consume, so their shapes are fixed here once.

Shape legend:
    B  batch (rows)
    L  tokens per row, prompt + response, RIGHT-padded (mask 1 on real tokens, then 0s)
    L1 L - 1: the positions that have a next token; entry t scores token t+1 given tokens 0..t
    V  vocabulary
    H  hidden size
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from loomrl.models.token_head import chunked_logprobs_and_entropy, fuses
from loomrl.workflow.batch import response_columns, row_ends

# Attribute names under which HF sequence-classification models keep their output projection.
_SCORE_HEAD_NAMES = ("score", "classifier")


def _scaled(logits_BTV: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits in float32, divided by the sampling temperature."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    # Log-probs must match what the sampler drew from, and the sampler divides by temperature.
    return logits_BTV.float() / temperature if temperature != 1.0 else logits_BTV.float()


def target_logprobs(logits_BTV: torch.Tensor, target_BT: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logp_BT: log p(target) under softmax(logits / temperature), where ``logits_BTV[:, t]`` scores
    ``target_BT[:, t]``."""
    scaled_BTV = _scaled(logits_BTV, temperature)
    # gather − logsumexp avoids a second B×T×V tensor that log_softmax would allocate.
    return scaled_BTV.gather(-1, target_BT.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled_BTV, dim=-1)


def target_logprobs_and_entropy(
    logits_BTV: torch.Tensor, target_BT: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_BT, entropy_BT): :func:`target_logprobs` and the entropy of each distribution."""
    scaled_BTV = _scaled(logits_BTV, temperature)
    logz_BT = torch.logsumexp(scaled_BTV, dim=-1)
    logp_BT = scaled_BTV.gather(-1, target_BT.unsqueeze(-1)).squeeze(-1) - logz_BT
    # H = logZ − Σ p·logit: one softmax tensor instead of both softmax and log_softmax.
    entropy_BT = logz_BT - (torch.softmax(scaled_BTV, dim=-1) * scaled_BTV).sum(dim=-1)
    return logp_BT, entropy_BT


def logprobs_from_logits(
    logits_BLV: torch.Tensor, input_ids_BL: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """logp_BL1: log p(token t+1 | tokens ≤ t) under softmax(logits / temperature), from a forward's logits."""
    return target_logprobs(logits_BLV[:, :-1], input_ids_BL[:, 1:], temperature)


def logprobs_and_entropy_from_logits(
    logits_BLV: torch.Tensor, input_ids_BL: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_BL1, entropy_BL1) from a forward's logits."""
    return target_logprobs_and_entropy(logits_BLV[:, :-1], input_ids_BL[:, 1:], temperature)


def token_logprobs(
    lm: PreTrainedModel, input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log p(token t+1 | tokens ≤ t) under softmax(logits / temperature); returns logp_BL1 in float32.

    Entries at padded positions are computed but meaningless; callers mask them.
    """
    logits_BLV = lm(input_ids=input_ids_BL, attention_mask=attention_mask_BL, use_cache=False).logits
    return logprobs_from_logits(logits_BLV, input_ids_BL, temperature)


def token_logprobs_and_entropy(
    lm: PreTrainedModel, input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_BL1, entropy_BL1): next-token log-probs and the entropy of each next-token distribution."""
    logits_BLV = lm(input_ids=input_ids_BL, attention_mask=attention_mask_BL, use_cache=False).logits
    return logprobs_and_entropy_from_logits(logits_BLV, input_ids_BL, temperature)


def is_value_model(model: nn.Module) -> bool:
    return any(isinstance(getattr(model, name, None), nn.Linear) for name in _SCORE_HEAD_NAMES)


def model_outputs(model: PreTrainedModel, input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor) -> torch.Tensor:
    """What a role's model produces per position: logits_BLV for a policy, values_BL for a value model (the
    same thing a pipeline's last stage returns)."""
    if is_value_model(model):
        return token_values(model, input_ids_BL, attention_mask_BL)
    return model(input_ids=input_ids_BL, attention_mask=attention_mask_BL, use_cache=False).logits


LOGP, ENTROPY = 0, 1
"""Indices of a policy's response outputs (B×R×2): the log-prob of response token t, and the entropy of the
distribution it was drawn from."""


def response_outputs(
    model: PreTrainedModel,
    input_ids_BL: torch.Tensor,
    attention_mask_BL: torch.Tensor,
    prompt_len_B: torch.Tensor,
    width: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """What a loss reads of a model's outputs over right-padded rows, at ``width`` response columns (column t at
    position prompt_len - 1 + t: :func:`~loomrl.workflow.batch.response_columns`): a value model's values_BR, or
    a policy's B×R×2 (:data:`LOGP`, :data:`ENTROPY`) of response token t under softmax(logits / temperature),
    zero past a row's response.

    The backbone runs over the whole rows and the head over the response tokens alone, a chunk at a time
    (:mod:`loomrl.models.token_head`): on a large vocabulary, logits for every position are most of a pass's
    arithmetic and memory."""
    if not applies_head_alone(model):
        whole = model_outputs(model, input_ids_BL, attention_mask_BL)
        return outputs_at_responses(whole, input_ids_BL, prompt_len_B, width, temperature)
    out = model.base_model(input_ids=input_ids_BL, attention_mask=attention_mask_BL, use_cache=False)
    hidden_BRH = response_columns(out.last_hidden_state, prompt_len_B, width)
    return head_at_responses(model, hidden_BRH, input_ids_BL, attention_mask_BL, prompt_len_B, temperature)


def head_at_responses(
    model: PreTrainedModel,
    hidden_BRH: torch.Tensor,
    input_ids_BL: torch.Tensor,
    attention_mask_BL: torch.Tensor,
    prompt_len_B: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """:func:`response_outputs` from the backbone's hidden states at the response columns."""
    if is_value_model(model):
        head = score_head(model)
        return head(hidden_BRH.to(head.weight.dtype)).squeeze(-1).float()
    width = hidden_BRH.shape[1]
    target_BR = response_columns(input_ids_BL[:, 1:], prompt_len_B, width)
    end_B = row_ends(attention_mask_BL)
    real_BR = torch.arange(width, device=hidden_BRH.device)[None, :] < (end_B - prompt_len_B)[:, None]
    hidden_NH, target_N = hidden_BRH[real_BR], target_BR[real_BR]
    if fuses(model.lm_head):
        logp_N, entropy_N = chunked_logprobs_and_entropy(hidden_NH, model.lm_head.weight, target_N, temperature)
    else:  # a sharded or biased head: its logits whole
        logp_N, entropy_N = target_logprobs_and_entropy(model.lm_head(hidden_NH), target_N, temperature)
    out_BR2 = torch.zeros((*real_BR.shape, 2), dtype=torch.float32, device=hidden_BRH.device)
    return out_BR2.index_put((real_BR,), torch.stack([logp_N, entropy_N], dim=-1))


def outputs_at_responses(
    out_BLX: torch.Tensor,
    input_ids_BL: torch.Tensor,
    prompt_len_B: torch.Tensor,
    width: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """:func:`response_outputs` from a whole forward's outputs (logits_BLV or values_BL), for passes that run
    whole rows (pipeline stages, FSDP): their logits are held whole."""
    cut = response_columns(out_BLX, prompt_len_B.to(out_BLX.device), width)
    if cut.dim() == 2:
        return cut
    target_BR = response_columns(input_ids_BL[:, 1:].to(cut.device), prompt_len_B.to(cut.device), width)
    return torch.stack(target_logprobs_and_entropy(cut, target_BR, temperature), dim=-1)


def applies_head_alone(model: PreTrainedModel) -> bool:
    """Whether the model's outputs are its head applied to its backbone's last hidden states and nothing else
    (no logit soft-capping or scaling after the head), so the head can run on chosen positions only."""
    config = model.config
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return False
    return is_value_model(model) or isinstance(getattr(model, "lm_head", None), nn.Module)


def score_head(value_model: PreTrainedModel) -> nn.Linear:
    """The linear layer mapping hidden states to the scalar output of a sequence-classification model."""
    for name in _SCORE_HEAD_NAMES:
        head = getattr(value_model, name, None)
        if isinstance(head, nn.Linear):
            return head
    raise TypeError(f"{type(value_model).__name__} has no linear score head (looked for {_SCORE_HEAD_NAMES})")


def token_values(
    value_model: PreTrainedModel, input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor
) -> torch.Tensor:
    """The score head applied at every position: values_BL in float32 (a critic's V(prefix ≤ t)).

    HF's own forward only returns the score at the last non-pad token; critics need all of them, so the
    backbone and the head are run separately.
    """
    out = value_model.base_model(input_ids=input_ids_BL, attention_mask=attention_mask_BL, use_cache=False)
    hidden_BLH = out.last_hidden_state
    head = score_head(value_model)
    return head(hidden_BLH.to(head.weight.dtype)).squeeze(-1).float()


def last_real_index(attention_mask_BL: torch.Tensor) -> torch.Tensor:
    """Index of the last position with mask 1 in each row (0 for an all-padding row)."""
    positions_BL = torch.arange(attention_mask_BL.shape[1], device=attention_mask_BL.device)
    # Max over masked positions rather than mask.sum()-1, so a stray hole in the mask cannot shift it.
    return (positions_BL * (attention_mask_BL != 0)).amax(dim=1)


def sequence_scores(
    value_model: PreTrainedModel, input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor
) -> torch.Tensor:
    """score_B: the per-token value at the last real token of each right-padded row (a reward model's output)."""
    values_BL = token_values(value_model, input_ids_BL, attention_mask_BL)
    last_B = last_real_index(attention_mask_BL)
    return values_BL.gather(1, last_B.unsqueeze(1)).squeeze(1)


def tied_embeddings(model: PreTrainedModel) -> bool:
    """Whether ``model``'s output head shares its input embedding: a causal LM whose head's weight is its
    embedding's, or, on a pipeline stage that replaced one of the two (``nn.Identity``), whose config ties word
    embeddings (what the whole model is). A value model's score head never does."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if isinstance(head, nn.Linear) and isinstance(embed, nn.Embedding):
        return head.weight is embed.weight
    return head is not None and bool(getattr(model.config, "tie_word_embeddings", False))
