"""Loss functions for RLHF training: PPO's clipped policy and value losses, KL estimators, entropy, and
the Bradley-Terry loss of reward-model training.

Pure functions over tensors. Token losses are averaged over all real tokens of the batch ("token-mean"),
so a long response weighs more than a short one, as in DAPO. Statistics are returned as plain floats,
detached from the graph, ready to log.

Shape legend (suffixes on tensor names):
    B  batch of samples (one response each)
    T  response tokens, right-padded
    V  vocabulary

``mask_BT`` is 1 (or True) on real response tokens and 0 on padding; padding never affects a loss or its
gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from loomrl.algorithms.advantages import masked_mean

__all__ = [
    "KL_ESTIMATORS",
    "bradley_terry_loss",
    "entropy_from_logits",
    "kl_estimate",
    "kl_penalty_loss",
    "policy_loss",
    "value_loss",
]

KL_ESTIMATORS = ("k1", "k2", "k3")


def _masked_diff(a_BT: Tensor, b_BT: Tensor, mask_BT: Tensor) -> Tensor:
    # Zero the difference on padding before any exp or square: garbage there (e.g. -inf log-probs)
    # would otherwise give inf in the forward pass and nan gradients through torch.where.
    keep = mask_BT if mask_BT.dtype == torch.bool else mask_BT != 0
    return torch.where(keep, a_BT - b_BT, torch.zeros((), dtype=a_BT.dtype, device=a_BT.device))


def kl_estimate(logp_BT: Tensor, ref_logp_BT: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(policy || reference) from log-probs of the sampled tokens.

    ``k1 = logp - ref`` is unbiased but can be negative; ``k2 = 0.5 * (logp - ref)^2`` is biased but
    non-negative; ``k3 = exp(ref - logp) - (ref - logp) - 1`` is unbiased and non-negative (Schulman,
    "Approximating KL divergence", 2020).
    """
    log_ratio_BT = logp_BT - ref_logp_BT
    if kind == "k1":
        return log_ratio_BT
    if kind == "k2":
        return 0.5 * log_ratio_BT.square()
    if kind == "k3":
        return torch.expm1(-log_ratio_BT) + log_ratio_BT
    raise ValueError(f"unknown KL estimator {kind!r}; valid: {', '.join(KL_ESTIMATORS)}")


def policy_loss(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate ``-min(r * A, clip(r, 1 - eps, 1 + eps_high) * A)``, token-mean.

    ``clip_eps_high`` (DAPO's clip-higher) widens only the upper bound; it defaults to ``clip_eps``.
    Stats: ``clipfrac``, the fraction of real tokens where the clipped term is the smaller one (so the
    token gives no gradient), and ``approx_kl``, the mean of ``0.5 * (logp - old_logp)^2``.
    """
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if clip_eps <= 0 or eps_high <= 0:
        raise ValueError(f"clip_eps and clip_eps_high must be > 0, got {clip_eps} and {eps_high}")
    log_ratio_BT = _masked_diff(logp_BT, old_logp_BT, mask_BT)
    ratio_BT = torch.exp(log_ratio_BT)
    surr_BT = ratio_BT * adv_BT
    clipped_surr_BT = ratio_BT.clamp(1.0 - clip_eps, 1.0 + eps_high) * adv_BT
    loss = masked_mean(-torch.minimum(surr_BT, clipped_surr_BT), mask_BT)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped_surr_BT < surr_BT).to(surr_BT.dtype), mask_BT).item(),
            "approx_kl": masked_mean(0.5 * log_ratio_BT.square(), mask_BT).item(),
        }
    return loss, stats


def value_loss(
    value_BT: Tensor, old_value_BT: Tensor, ret_BT: Tensor, mask_BT: Tensor, clip_eps: float
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss ``0.5 * max((v - R)^2, (clip(v, old - eps, old + eps) - R)^2)``, token-mean.

    Stat ``vf_clipfrac``: fraction of real tokens where the clipped error is the larger one.
    """
    if clip_eps <= 0:
        raise ValueError(f"clip_eps must be > 0, got {clip_eps}")
    delta_BT = _masked_diff(value_BT, old_value_BT, mask_BT)
    clipped_BT = old_value_BT + delta_BT.clamp(-clip_eps, clip_eps)
    err_BT = _masked_diff(value_BT, ret_BT, mask_BT).square()
    clipped_err_BT = _masked_diff(clipped_BT, ret_BT, mask_BT).square()
    loss = 0.5 * masked_mean(torch.maximum(err_BT, clipped_err_BT), mask_BT)
    with torch.no_grad():
        stats = {"vf_clipfrac": masked_mean((clipped_err_BT > err_BT).to(err_BT.dtype), mask_BT).item()}
    return loss, stats


def entropy_from_logits(logits_BTV: Tensor) -> Tensor:
    """Entropy of the categorical distribution at each position, in nats.

    Logits of ``-inf`` (tokens filtered out, e.g. by top-k) are allowed and contribute 0.
    """
    logp_BTV = F.log_softmax(logits_BTV, dim=-1)
    # 0 * log 0 is taken as 0; filling before the product keeps both forward and gradient finite.
    safe_logp_BTV = logp_BTV.masked_fill(torch.isneginf(logp_BTV), 0.0)
    return -(logp_BTV.exp() * safe_logp_BTV).sum(dim=-1)


def kl_penalty_loss(
    logp_BT: Tensor, ref_logp_BT: Tensor, mask_BT: Tensor, kind: str = "k3"
) -> Tensor:
    """Token-mean of a KL estimator, used as a loss term (GRPO puts the KL in the loss, not the reward)."""
    log_ratio_BT = _masked_diff(logp_BT, ref_logp_BT, mask_BT)
    return masked_mean(kl_estimate(log_ratio_BT, torch.zeros_like(log_ratio_BT), kind), mask_BT)


def bradley_terry_loss(chosen_B: Tensor, rejected_B: Tensor) -> tuple[Tensor, float]:
    """Reward-model loss ``-log sigmoid(chosen - rejected)``, mean over pairs, and the pair accuracy.

    Accuracy counts a tie as wrong: the model must rank the chosen response strictly higher.
    """
    margin_B = chosen_B - rejected_B
    loss = -F.logsigmoid(margin_B).mean()
    accuracy = (margin_B > 0).to(margin_B.dtype).mean().item()
    return loss, accuracy
