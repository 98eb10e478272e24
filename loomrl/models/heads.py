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

# Attribute names under which HF sequence-classification models keep their output projection.
_SCORE_HEAD_NAMES = ("score", "classifier")


def _scaled_next_token_logits(logits_BLV: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits for positions 0..L-2 in float32, divided by the sampling temperature."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits_BL1V = logits_BLV[:, :-1].float()
    # Log-probs must match what the sampler drew from, and the sampler divides by temperature.
    return logits_BL1V / temperature if temperature != 1.0 else logits_BL1V


def logprobs_from_logits(
    logits_BLV: torch.Tensor, input_ids_BL: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """logp_BL1: log p(token t+1 | tokens ≤ t) under softmax(logits / temperature), from a forward's logits."""
    logits_BL1V = _scaled_next_token_logits(logits_BLV, temperature)
    # gather − logsumexp avoids a second B×L×V tensor that log_softmax would allocate.
    target_BL1 = input_ids_BL[:, 1:].unsqueeze(-1)
    picked_BL1 = logits_BL1V.gather(-1, target_BL1).squeeze(-1)
    return picked_BL1 - torch.logsumexp(logits_BL1V, dim=-1)


def logprobs_and_entropy_from_logits(
    logits_BLV: torch.Tensor, input_ids_BL: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_BL1, entropy_BL1) from a forward's logits."""
    logits_BL1V = _scaled_next_token_logits(logits_BLV, temperature)
    logz_BL1 = torch.logsumexp(logits_BL1V, dim=-1)
    target_BL1 = input_ids_BL[:, 1:].unsqueeze(-1)
    logp_BL1 = logits_BL1V.gather(-1, target_BL1).squeeze(-1) - logz_BL1
    # H = logZ − Σ p·logit: one softmax tensor instead of both softmax and log_softmax.
    probs_BL1V = torch.softmax(logits_BL1V, dim=-1)
    entropy_BL1 = logz_BL1 - (probs_BL1V * logits_BL1V).sum(dim=-1)
    return logp_BL1, entropy_BL1


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
