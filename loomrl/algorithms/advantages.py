"""Advantage and return estimators for RLHF: the pure tensor math that tells the algorithms apart.

PPO uses per-token rewards (KL penalty plus the sequence score on the last token) and GAE against a
critic; GRPO, RLOO and ReMax replace the critic with a baseline computed from other samples of the same
prompt; REINFORCE++ uses discounted returns whitened over the whole batch. Scores may first be shaped
(:func:`overlong_penalty`, DAPO's soft overlong punishment). Every function here is a pure function of tensors:
no models, no I/O, no hidden state.

Shape legend (suffixes on tensor names):
    B  batch of samples (one response each)
    T  response tokens, right-padded
    G  group size: samples of the same prompt, laid out consecutively in the batch

``mask_BT`` is 1 (or True) on real response tokens, which form a prefix of each row, and 0 on padding.
Padding positions never influence a result, and every ``_BT`` result is 0 on padding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "broadcast_to_tokens",
    "credit_by_turn",
    "discounted_returns",
    "gae",
    "group_normalized",
    "group_scale",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "reinforce_pp_advantage",
    "remax_advantage",
    "rloo_baseline",
    "token_rewards",
]


def _bool_mask(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _zero_padding(x: Tensor, mask: Tensor) -> Tensor:
    # torch.where rather than x * mask: padding may hold inf or nan (e.g. log-probs of pad tokens),
    # and inf * 0 would leak nan into the result.
    return torch.where(_bool_mask(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the elements where ``mask`` is set, over all elements or along ``dim``.

    Along ``dim``, a slice with no masked element has mean 0 rather than nan, so that an empty response
    does not poison a batch statistic.
    """
    mask_b = _bool_mask(mask)
    total = _zero_padding(x, mask_b)
    count = mask_b.to(x.dtype)
    if dim is None:
        return total.sum() / count.sum()
    return total.sum(dim) / count.sum(dim).clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over all masked elements; ``unbiased`` applies Bessel's correction."""
    mask_b = _bool_mask(mask)
    count = int(mask_b.sum())
    if count == 0 or (unbiased and count < 2):
        raise ValueError(f"masked_var needs at least {2 if unbiased else 1} masked elements, got {count}")
    centred = x - masked_mean(x, mask_b)
    var = masked_mean(centred * centred, mask_b)
    if unbiased:
        var = var * (count / (count - 1))
    return var


def masked_whiten(
    x: Tensor,
    mask: Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    reduce: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Normalise ``x`` to unit variance (and zero mean if ``shift_mean``) over its masked elements.

    With ``shift_mean=False`` the mean is kept, so only the scale changes (as for PPO's rewards). ``reduce``:
    ``x`` is one shard of the batch and ``reduce`` sums a tensor over every shard, so the mean and variance are
    the whole batch's (the same as unsharded, up to the order of the sums).
    """
    if reduce is None:
        mean, var = masked_mean(x, mask), masked_var(x, mask)
    else:
        mean, var = _sharded_moments(x, mask, reduce)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return _zero_padding(whitened, mask)


def _sharded_moments(x: Tensor, mask: Tensor, reduce: Callable[[Tensor], Tensor]) -> tuple[Tensor, Tensor]:
    """The masked mean and unbiased variance of the union of every shard's ``x`` (two reductions: the sum and
    count, then the squared deviations from the global mean, as :func:`masked_var` computes them)."""
    mask_b = _bool_mask(mask)
    sums = reduce(torch.stack([_zero_padding(x, mask_b).sum(), mask_b.sum().to(x.dtype)]))
    total, count = sums[0], sums[1]
    if count < 2:
        raise ValueError(f"masked_var needs at least 2 masked elements, got {int(count)}")
    mean = total / count
    centred = _zero_padding(x - mean, mask_b)
    return mean, reduce((centred * centred).sum()) / (count - 1)


def overlong_penalty(length_B: Tensor, max_new_tokens: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment, as the amount to subtract from each response's reward: 0 up to
    ``max_new_tokens - buffer`` tokens, then ``penalty * (length - (max_new_tokens - buffer)) / buffer``, rising
    linearly to ``penalty`` at ``max_new_tokens`` (and staying there beyond it). ``buffer`` 0 punishes nothing.
    """
    if buffer < 0 or buffer > max_new_tokens:
        raise ValueError(f"overlong buffer must be in [0, max_new_tokens={max_new_tokens}], got {buffer}")
    dtype = length_B.dtype if length_B.is_floating_point() else torch.float32
    if buffer == 0:
        return torch.zeros(length_B.shape, dtype=dtype, device=length_B.device)
    excess_B = (length_B.to(dtype) - (max_new_tokens - buffer)).clamp(min=0, max=buffer)
    return penalty * excess_B / buffer


def _last_token_index(mask_BT: Tensor) -> tuple[Tensor, Tensor]:
    """(index of each row's last real token, whether the row has any real token)."""
    mask_b = _bool_mask(mask_BT)
    positions_BT = torch.arange(mask_b.shape[-1], device=mask_b.device).expand_as(mask_b)
    last_B = torch.where(mask_b, positions_BT, -1).amax(dim=-1)
    return last_B.clamp(min=0), last_B >= 0


def token_rewards(
    score_B: Tensor, kl_BT: Tensor, mask_BT: Tensor, kl_coef: float, earned_BT: Tensor | None = None
) -> Tensor:
    """PPO-RLHF per-token reward: ``-kl_coef * kl`` on every real token, plus the score on the last one.

    With ``earned_BT`` (a multi-turn episode's step rewards on the tokens that earned them, credit rule
    ``turn``), those rewards stay where they are and only the rest of the score (what the steps do not add up
    to: a budget penalty, DAPO's overlong penalty) goes on the last token. A row with no real token cannot carry
    its score anywhere and gets an all-zero reward.
    """
    reward_BT = _zero_padding(-kl_coef * kl_BT, mask_BT)
    if earned_BT is not None:
        earned_BT = _zero_padding(earned_BT.to(reward_BT.dtype), mask_BT)
        reward_BT = reward_BT + earned_BT
        score_B = score_B - earned_BT.sum(dim=-1)
    last_B, nonempty_B = _last_token_index(mask_BT)
    bonus_B = torch.where(nonempty_B, score_B.to(reward_BT.dtype), 0.0)
    return reward_BT.scatter_add(1, last_B.unsqueeze(1), bonus_B.unsqueeze(1))


def gae(reward_BT: Tensor, value_BT: Tensor, mask_BT: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the response tokens; returns ``(adv_BT, ret_BT)``.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``, where the
    value after a row's last real token is 0 because the episode ends there. ``ret = adv + value``.

    Masked tokens are skipped, not ends: inside a row (a multi-turn episode's observation tokens, which the
    policy did not choose) the recursion passes over them to the next real token, so an episode's turns are one
    trajectory, exactly as if the observation tokens were not there; after the last real token (padding) there
    is nothing to pass on.
    """
    m_BT = _bool_mask(mask_BT)
    reward_BT = _zero_padding(reward_BT, mask_BT)
    value_BT = _zero_padding(value_BT, mask_BT)
    T = reward_BT.shape[1]
    adv_BT = torch.zeros_like(value_BT)
    next_value_B = torch.zeros_like(value_BT[:, 0])
    next_adv_B = torch.zeros_like(value_BT[:, 0])
    for t in reversed(range(T)):
        delta_B = reward_BT[:, t] + gamma * next_value_B - value_BT[:, t]
        real_B = m_BT[:, t]
        next_adv_B = torch.where(real_B, delta_B + gamma * lam * next_adv_B, next_adv_B)
        next_value_B = torch.where(real_B, value_BT[:, t], next_value_B)
        adv_BT[:, t] = torch.where(real_B, next_adv_B, 0.0)
    return adv_BT, (adv_BT + value_BT) * m_BT.to(value_BT.dtype)


def discounted_returns(reward_BT: Tensor, mask_BT: Tensor, gamma: float) -> Tensor:
    """Reward-to-go ``G_t = r_t + gamma * G_{t+1}`` over the real tokens of each row (masked tokens inside a row
    skipped, as in :func:`gae`)."""
    m_BT = _bool_mask(mask_BT)
    reward_BT = _zero_padding(reward_BT, mask_BT)
    ret_BT = torch.zeros_like(reward_BT)
    running_B = torch.zeros_like(reward_BT[:, 0])
    for t in reversed(range(reward_BT.shape[1])):
        running_B = torch.where(m_BT[:, t], reward_BT[:, t] + gamma * running_B, running_B)
        ret_BT[:, t] = torch.where(m_BT[:, t], running_B, 0.0)
    return ret_BT


def _grouped(score_B: Tensor, group_size: int, min_size: int, what: str) -> Tensor:
    if group_size < min_size:
        raise ValueError(f"{what} needs group_size >= {min_size}, got {group_size}")
    if score_B.dim() != 1 or score_B.shape[0] % group_size != 0:
        raise ValueError(
            f"{what} needs a 1-D score whose length is a multiple of group_size={group_size}, "
            f"got shape {tuple(score_B.shape)}"
        )
    return score_B.view(-1, group_size)


def group_normalized(score_B: Tensor, group_size: int, eps: float = 1e-6, std_normalize: bool = True) -> Tensor:
    """GRPO advantage: score minus its group's mean, divided by the group's (unbiased) std plus eps.

    ``std_normalize=False`` only subtracts the mean, as Dr. GRPO recommends to avoid favouring groups
    whose scores barely differ.
    """
    score_BG = _grouped(score_B, group_size, 2 if std_normalize else 1, "group_normalized")
    adv_BG = score_BG - score_BG.mean(dim=1, keepdim=True)
    if std_normalize:
        adv_BG = adv_BG / (score_BG.std(dim=1, unbiased=True, keepdim=True) + eps)
    return adv_BG.reshape(-1)


def group_scale(score_B: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """Each row's GRPO scale: one over its group's (unbiased) score std plus eps (what :func:`group_normalized`
    divides by)."""
    score_BG = _grouped(score_B, group_size, 2, "group_scale")
    return (1.0 / (score_BG.std(dim=1, unbiased=True, keepdim=True) + eps)).expand_as(score_BG).reshape(-1)


def credit_by_turn(adv_B: Tensor, score_B: Tensor, earned_BT: Tensor, mask_BT: Tensor, scale_B: Tensor) -> Tensor:
    """Turn credit for the group baselines (GRPO, RLOO): each token's advantage is its row's ``adv_B`` less the
    scaled rewards its episode earned *before* the token's turn, so a turn is credited with the reward-to-go from
    its own step on, never with what earlier turns earned.

    The reward-to-go at a row's first token is its whole score, so the first turn keeps ``adv_B``, and an episode
    rewarded only at its end is credited exactly as under the episode rule. ``earned_BT`` is the step rewards on
    the tokens that earned them (the rest of the score counts as earned at the last token, as in
    :func:`token_rewards`); ``scale_B`` is what the baseline scales scores by (:func:`group_scale` for GRPO, 1 for
    RLOO).
    """
    zero_BT = torch.zeros_like(earned_BT, dtype=adv_B.dtype)
    to_go_BT = discounted_returns(token_rewards(score_B, zero_BT, mask_BT, 0.0, earned_BT), mask_BT, 1.0)
    earlier_BT = score_B.to(adv_B.dtype).unsqueeze(1) - to_go_BT
    return _zero_padding(adv_B.unsqueeze(1) - scale_B.to(adv_B.dtype).unsqueeze(1) * earlier_BT, mask_BT)


def rloo_baseline(score_B: Tensor, group_size: int) -> Tensor:
    """RLOO advantage: each score minus the mean of the other ``group_size - 1`` scores of its group."""
    score_BG = _grouped(score_B, group_size, 2, "rloo_baseline")
    others_mean_BG = (score_BG.sum(dim=1, keepdim=True) - score_BG) / (group_size - 1)
    return (score_BG - others_mean_BG).reshape(-1)


def remax_advantage(score_B: Tensor, greedy_score_B: Tensor) -> Tensor:
    """ReMax advantage: each score minus the score of the greedy response to the same prompt."""
    if score_B.shape != greedy_score_B.shape:
        raise ValueError(
            f"remax_advantage needs scores of equal shape, got {tuple(score_B.shape)} and {tuple(greedy_score_B.shape)}"
        )
    return score_B - greedy_score_B


def broadcast_to_tokens(adv_B: Tensor, mask_BT: Tensor) -> Tensor:
    """Give every real token of a row its sequence-level advantage; padding gets 0."""
    return _zero_padding(adv_B.unsqueeze(1).expand(mask_BT.shape), mask_BT)


def reinforce_pp_advantage(
    score_B: Tensor,
    kl_BT: Tensor,
    mask_BT: Tensor,
    kl_coef: float,
    gamma: float = 1.0,
    reduce: Callable[[Tensor], Tensor] | None = None,
    earned_BT: Tensor | None = None,
) -> Tensor:
    """REINFORCE++ advantage: discounted returns of the PPO token rewards (``earned_BT``: see
    :func:`token_rewards`), whitened over the batch.

    Normalising over all real tokens of the batch (not per prompt group) is what distinguishes
    REINFORCE++ from GRPO.
    """
    ret_BT = discounted_returns(token_rewards(score_B, kl_BT, mask_BT, kl_coef, earned_BT), mask_BT, gamma)
    return masked_whiten(ret_BT, mask_BT, reduce=reduce)
