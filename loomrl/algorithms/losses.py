"""Loss functions for RLHF training: PPO's clipped policy and value losses, KL estimators, entropy, and
the Bradley-Terry loss of reward-model training.

Pure functions over tensors. Token losses become one number by :func:`aggregate`: by default averaged over all
real tokens of the batch ("token-mean"), so a long response weighs more than a short one, as in DAPO; or per
response first ("seq-mean-token-mean", the GRPO paper's; "seq-mean-token-sum", Dr. GRPO's). The policy objective
is PPO's token-level clipped ratio or GSPO's sequence-level one (:func:`gspo_loss`). Statistics are returned as
plain floats, detached from the graph, ready to log.

Shape legend (suffixes on tensor names):
    B  batch of samples (one response each)
    T  response tokens, right-padded
    V  vocabulary

``mask_BT`` is 1 (or True) on real response tokens and 0 on padding; padding never affects a loss or its
gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from loomrl.algorithms.advantages import masked_mean

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGGS",
    "LOSS_AGG_UNITS",
    "OFF_POLICY",
    "POLICY_LOSSES",
    "aggregate",
    "behaviour_weights",
    "bradley_terry_loss",
    "entropy_from_logits",
    "geometric_ratio",
    "geometric_rejected",
    "gspo_loss",
    "kl_estimate",
    "kl_penalty_loss",
    "policy_loss",
    "policy_objective",
    "token_stat",
    "value_loss",
]

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGG_UNITS = {"token-mean": "token", "seq-mean-token-mean": "sequence", "seq-mean-token-sum": "sequence"}
"""Per aggregation, what one row of a batch counts for in its mean (the weight a micro-batch's or a data-parallel
rank's loss takes in the whole minibatch's): its real tokens, or one per sequence
(:func:`loomrl.workflow.minibatches.loss_weights`)."""
LOSS_AGGS = tuple(LOSS_AGG_UNITS)


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


def aggregate(loss_BT: Tensor, mask_BT: Tensor, loss_agg: str = "token-mean") -> Tensor:
    """One number from per-token values over the real tokens: ``token-mean`` averages all of the batch's tokens;
    ``seq-mean-token-mean`` averages each row's tokens, then the rows; ``seq-mean-token-sum`` sums each row's
    tokens, then averages the rows (Dr. GRPO's objective; its code also divides by a constant, the longest
    response allowed, which only rescales it).

    A row without real tokens counts as 0 in the sequence means. The mean of a split batch is the weighted mean
    of its parts' with weights from :data:`LOSS_AGG_UNITS` (tokens or rows), which is how micro-batches and
    data-parallel ranks recombine it exactly.
    """
    if loss_agg == "token-mean":
        return masked_mean(loss_BT, mask_BT)
    if loss_agg == "seq-mean-token-mean":
        return masked_mean(loss_BT, mask_BT, dim=1).mean()
    if loss_agg == "seq-mean-token-sum":
        keep = mask_BT if mask_BT.dtype == torch.bool else mask_BT != 0
        return loss_BT.masked_fill(~keep, 0.0).sum(dim=1).mean()
    raise ValueError(f"unknown loss aggregation {loss_agg!r}; valid: {', '.join(LOSS_AGGS)}")


def token_stat(x_BT: Tensor, mask_BT: Tensor, loss_agg: str = "token-mean") -> Tensor:
    """A per-token statistic's mean (for logging) over the units the loss is averaged over: every token for
    ``token-mean``, else each sequence's tokens, then the sequences. Either way a split batch's value is its parts'
    weighted by the loss's own weights (:data:`LOSS_AGG_UNITS`), so micro-batches and ranks recombine it exactly."""
    unit = LOSS_AGG_UNITS.get(loss_agg)
    if unit is None:
        raise ValueError(f"unknown loss aggregation {loss_agg!r}; valid: {', '.join(LOSS_AGGS)}")
    return masked_mean(x_BT, mask_BT) if unit == "token" else masked_mean(x_BT, mask_BT, dim=1).mean()


def _clip_range(clip_eps: float, clip_eps_high: float | None) -> float:
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if clip_eps <= 0 or eps_high <= 0:
        raise ValueError(f"clip_eps and clip_eps_high must be > 0, got {clip_eps} and {eps_high}")
    return eps_high


def _clipped_surrogate(
    log_ratio_BT: Tensor,
    token_log_ratio_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip_eps: float,
    eps_high: float,
    loss_agg: str,
    weight_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """``-min(r * A, clip(r) * A)`` aggregated, with ``r = exp(log_ratio_BT)``, each token's term times its
    ``weight_BT`` where given (an off-policy correction: :func:`behaviour_weights`); ``token_log_ratio_BT`` (each
    token's own ``logp - old_logp``) only feeds the ``approx_kl`` statistic."""
    ratio_BT = torch.exp(log_ratio_BT)
    surr_BT = ratio_BT * adv_BT
    clipped_surr_BT = ratio_BT.clamp(1.0 - clip_eps, 1.0 + eps_high) * adv_BT
    token_loss_BT = -torch.minimum(surr_BT, clipped_surr_BT)
    if weight_BT is not None:
        token_loss_BT = token_loss_BT * weight_BT
    loss = aggregate(token_loss_BT, mask_BT, loss_agg)
    with torch.no_grad():
        stats = {
            "clipfrac": token_stat((clipped_surr_BT < surr_BT).to(surr_BT.dtype), mask_BT, loss_agg).item(),
            "approx_kl": token_stat(0.5 * token_log_ratio_BT.square(), mask_BT, loss_agg).item(),
        }
    return loss, stats


def policy_loss(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
    loss_agg: str = "token-mean",
    weight_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate ``-min(r * A, clip(r, 1 - eps, 1 + eps_high) * A)`` per token, ``r`` the token's
    importance ratio, aggregated by ``loss_agg`` (:func:`aggregate`).

    ``clip_eps_high`` (DAPO's clip-higher) widens only the upper bound; it defaults to ``clip_eps``.
    ``weight_BT`` multiplies each token's term (an off-policy correction, :func:`behaviour_weights`).
    Stats: ``clipfrac``, the fraction of real tokens where the clipped term is the smaller one (so the
    token gives no gradient), and ``approx_kl``, the mean of ``0.5 * (logp - old_logp)^2``, both per token
    (:func:`token_stat`: over the batch's tokens, or each sequence's and then the sequences').
    """
    eps_high = _clip_range(clip_eps, clip_eps_high)
    log_ratio_BT = _masked_diff(logp_BT, old_logp_BT, mask_BT)
    return _clipped_surrogate(log_ratio_BT, log_ratio_BT, adv_BT, mask_BT, clip_eps, eps_high, loss_agg, weight_BT)


def gspo_loss(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
    loss_agg: str = "token-mean",
    weight_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025): PPO's clipped surrogate on each response's importance ratio
    ``s = exp(mean over its tokens of (logp - old_logp))``, clipped per response to ``[1 - eps, 1 + eps_high]``.

    Written in the paper's GSPO-token form: every token's ratio is ``sg(s) * p(token) / sg(p(token))``, equal to
    ``s`` in value, so a response is clipped as a whole, and with one advantage per response (grpo, rloo, remax)
    the gradient is GSPO's exactly: ``A * grad s`` spread over the tokens as ``A * s * grad logp``. With
    ``loss_agg="seq-mean-token-mean"`` the loss is the paper's mean over responses; ``token-mean`` weighs each
    response by its length. Per-token advantages (ppo, reinforce_pp) weight each token's gradient by its own.
    Clip ranges are the paper's scale, e.g. ``clip_eps=3e-4, clip_eps_high=4e-4``. Stats as :func:`policy_loss`
    (``clipfrac`` counts the tokens of clipped responses).
    """
    eps_high = _clip_range(clip_eps, clip_eps_high)
    token_log_ratio_BT = _masked_diff(logp_BT, old_logp_BT, mask_BT)
    seq_log_ratio_B = masked_mean(token_log_ratio_BT, mask_BT, dim=1)
    # logp - sg(logp) is 0 in value and carries each token's gradient; the sequence ratio is a constant
    log_ratio_BT = seq_log_ratio_B.detach().unsqueeze(1) + _masked_diff(logp_BT, logp_BT.detach(), mask_BT)
    return _clipped_surrogate(
        log_ratio_BT, token_log_ratio_BT, adv_BT, mask_BT, clip_eps, eps_high, loss_agg, weight_BT
    )


POLICY_LOSSES = ("ppo", "gspo")
OFF_POLICY = ("none", "decoupled", "tis", "mis", "geo_reject")


def geometric_ratio(prox_logp_BT: Tensor, behav_logp_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Each response's geometric-mean importance ratio ``exp(mean over its tokens of (prox - behav))`` (1 for a
    response without real tokens)."""
    return torch.exp(masked_mean(_masked_diff(prox_logp_BT, behav_logp_BT, mask_BT), mask_BT, dim=1))


def geometric_rejected(prox_logp_BT: Tensor, behav_logp_BT: Tensor, mask_BT: Tensor, low: float, cap: float) -> Tensor:
    """Which responses ``geo_reject`` leaves out (B booleans): those whose :func:`geometric_ratio` leaves
    ``[low, cap]``."""
    g_B = geometric_ratio(prox_logp_BT, behav_logp_BT, mask_BT)
    return (g_B < low) | (g_B > cap)


def behaviour_weights(
    prox_logp_BT: Tensor,
    behav_logp_BT: Tensor,
    mask_BT: Tensor,
    kind: str,
    cap: float,
    loss_agg: str = "token-mean",
    low: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Per-token importance weights ``w = pi_prox / pi_behav`` that correct a policy loss for samples drawn by an
    older (behaviour) policy than the proximal one the ratio is clipped around (``old_logp``: the policy at the
    update's start), or by another implementation of the same one (the rollout engine's numerics), and their
    statistics.

    ``decoupled`` is AReaL's decoupled PPO objective (Fu et al. 2025): ``w`` as it is, a token whose ``w`` exceeds
    ``cap`` left out (weight 0); ``tis`` is token-level truncated importance sampling (Yao et al. 2025):
    ``min(w, cap)``; ``mis`` is masked importance sampling as IcePop's (Ling team 2025): ``w`` where it lies in
    ``[low, cap]``, the token left out otherwise; ``geo_reject`` is sequence-level geometric rejection: a response
    whose geometric-mean ratio (:func:`geometric_ratio`) leaves ``[low, cap]`` is left out whole, the others weigh 1
    (rejection alone, as verl's geometric rejection sampling: the band bounds how far off-policy a kept response
    is). Stats: ``is_weight``, the mean of ``w`` before capping; ``is_capped`` (``decoupled``, ``tis``), the
    fraction of tokens capped or left out; ``is_dropped`` (``mis``, ``geo_reject``), the fraction left out; all
    per token as :func:`token_stat` (under the sequence-mean aggregations a fraction of responses). How many
    responses ``geo_reject`` leaves out of a batch is :func:`geometric_rejected`'s count.
    """
    if kind not in OFF_POLICY[1:]:
        raise ValueError(f"unknown off-policy correction {kind!r}; valid: {', '.join(OFF_POLICY[1:])}")
    with torch.no_grad():
        w_BT = torch.exp(_masked_diff(prox_logp_BT, behav_logp_BT, mask_BT))
        if kind == "geo_reject":
            out_BT = geometric_rejected(prox_logp_BT, behav_logp_BT, mask_BT, low, cap).unsqueeze(1).expand_as(w_BT)
            weight_BT = (~out_BT).to(w_BT.dtype)
        else:
            out_BT = (w_BT < low) | (w_BT > cap) if kind == "mis" else w_BT > cap
            weight_BT = w_BT.clamp(max=cap) if kind == "tis" else w_BT.masked_fill(out_BT, 0.0)
        stats = {
            "is_weight": token_stat(w_BT, mask_BT, loss_agg).item(),
            "is_capped" if kind in ("decoupled", "tis") else "is_dropped": token_stat(
                out_BT.to(w_BT.dtype), mask_BT, loss_agg
            ).item(),
        }
    return weight_BT, stats


def policy_objective(name: str) -> Callable[..., tuple[Tensor, dict[str, float]]]:
    """The policy loss named ``name`` (``algo.policy_loss``), with :func:`policy_loss`'s signature: ``ppo``
    (:func:`policy_loss`) or ``gspo`` (:func:`gspo_loss`)."""
    if name == "ppo":
        return policy_loss
    if name == "gspo":
        return gspo_loss
    raise ValueError(f"unknown policy loss {name!r}; valid: {', '.join(POLICY_LOSSES)}")


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
    logp_BT: Tensor, ref_logp_BT: Tensor, mask_BT: Tensor, kind: str = "k3", loss_agg: str = "token-mean"
) -> Tensor:
    """A KL estimator aggregated as the policy loss is (:func:`aggregate`; token-mean by default), used as a loss
    term (GRPO puts the KL in the loss, not the reward)."""
    log_ratio_BT = _masked_diff(logp_BT, ref_logp_BT, mask_BT)
    return aggregate(kl_estimate(log_ratio_BT, torch.zeros_like(log_ratio_BT), kind), mask_BT, loss_agg)


def bradley_terry_loss(chosen_B: Tensor, rejected_B: Tensor) -> tuple[Tensor, float]:
    """Reward-model loss ``-log sigmoid(chosen - rejected)``, mean over pairs, and the pair accuracy.

    Accuracy counts a tie as wrong: the model must rank the chosen response strictly higher.
    """
    margin_B = chosen_B - rejected_B
    loss = -F.logsigmoid(margin_B).mean()
    accuracy = (margin_B > 0).to(margin_B.dtype).mean().item()
    return loss, accuracy
