"""Losses against values worked out by hand, with clipping active and inactive, padding, and gradients."""

import math

import pytest
import torch

from loomrl.algorithms.losses import (
    KL_ESTIMATORS,
    bradley_terry_loss,
    entropy_from_logits,
    kl_estimate,
    kl_penalty_loss,
    policy_loss,
    value_loss,
)

LN2, LN_1_5, LN_0_5 = math.log(2.0), math.log(1.5), math.log(0.5)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# --- KL estimators ---------------------------------------------------------------------------------------


def test_kl_estimators_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    # token 0: logp - ref = ln 2;  token 1: logp - ref = -ln 2
    close(kl_estimate(logp, ref, "k1"), [[LN2, -LN2]])
    close(kl_estimate(logp, ref, "k2"), [[0.5 * LN2**2, 0.5 * LN2**2]])
    # k3 = exp(ref - logp) - (ref - logp) - 1:  token 0: 0.5 + ln 2 - 1;  token 1: 2 - ln 2 - 1
    close(kl_estimate(logp, ref, "k3"), [[LN2 - 0.5, 1.0 - LN2]])


def test_k1_and_k3_are_unbiased_under_the_policy():
    # Expectation over tokens sampled from p, computed exactly by weighting each token with p.
    p, q = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.4, 0.5, 0.1])
    true_kl = (p * (p / q).log()).sum()
    for kind in ("k1", "k3"):
        close((p * kl_estimate(p.log(), q.log(), kind)).sum(), true_kl)
    assert not torch.isclose((p * kl_estimate(p.log(), q.log(), "k2")).sum(), true_kl)


def test_k2_and_k3_are_non_negative():
    gen = torch.Generator().manual_seed(0)
    logp, ref = torch.randn(64, 32, generator=gen) * 3, torch.randn(64, 32, generator=gen) * 3
    for kind in ("k2", "k3"):
        assert (kl_estimate(logp, ref, kind) >= 0).all()
    assert (kl_estimate(logp, ref, "k1") < 0).any()  # k1 alone can go negative


def test_unknown_kl_estimator_names_valid_ones():
    assert KL_ESTIMATORS == ("k1", "k2", "k3")
    with pytest.raises(ValueError, match="'k4'.*k1, k2, k3"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


def test_kl_penalty_loss_masked_mean_and_gradient():
    logp = torch.tensor([[math.log(0.5), math.log(0.25), -math.inf]], requires_grad=True)
    ref = torch.log(torch.tensor([[0.25, 0.5, 0.5]]))
    mask = torch.tensor([[1, 1, 0]])
    # k3 per token: (ln 2 - 0.5) + (1 - ln 2) = 0.5, mean over 2 real tokens = 0.25; the -inf pad is ignored
    loss = kl_penalty_loss(logp, ref, mask)
    close(loss, 0.25)
    loss.backward()
    # d k3 / d logp = 1 - exp(ref - logp): token 0: 1 - 0.5, token 1: 1 - 2; each divided by 2 tokens
    close(logp.grad, [[0.25, -0.5, 0.0]])
    close(kl_penalty_loss(logp, ref, mask, kind="k1"), 0.0)  # (ln 2 - ln 2) / 2


# --- PPO policy loss -------------------------------------------------------------------------------------


def test_policy_loss_without_clipping_is_minus_mean_advantage():
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    adv = torch.tensor([[1.0, -2.0, 50.0]])
    loss, stats = policy_loss(logp, logp.clone(), adv, torch.tensor([[1, 1, 0]]), clip_eps=0.2)
    close(loss, 0.5)  # ratio 1: -(1 - 2) / 2
    assert stats == {"clipfrac": 0.0, "approx_kl": 0.0}


def _clip_case():
    # eps = 0.2, so the ratio is clipped to [0.8, 1.2]
    # a: r 1.5, A +1: min(1.5, 1.2)   = 1.2  clipped
    # b: r 1.5, A -1: min(-1.5, -1.2) = -1.5 not clipped
    # c: r 0.5, A -1: min(-0.5, -0.8) = -0.8 clipped
    # d: r 0.5, A +1: min(0.5, 0.8)   = 0.5  not clipped
    old = torch.zeros(1, 4)
    logp = torch.tensor([[LN_1_5, LN_1_5, LN_0_5, LN_0_5]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    return logp, old, adv


def test_policy_loss_clipping_active_by_hand():
    logp, old, adv = _clip_case()
    loss, stats = policy_loss(logp, old, adv, torch.ones(1, 4), clip_eps=0.2)
    close(loss, 0.15)  # -(1.2 - 1.5 - 0.8 + 0.5) / 4
    assert stats["clipfrac"] == pytest.approx(0.5)
    # approx_kl = mean of 0.5 * (ln 1.5^2, ln 1.5^2, ln 0.5^2, ln 0.5^2)
    assert stats["approx_kl"] == pytest.approx(0.5 * (2 * LN_1_5**2 + 2 * LN_0_5**2) / 4)
    loss.backward()
    # clipped tokens give no gradient; unclipped: d(-r*A/4)/dlogp = -r*A/4
    close(logp.grad, [[0.0, 1.5 / 4, 0.0, -0.5 / 4]])


def test_policy_loss_clip_higher_widens_only_upper_bound():
    logp, old, adv = torch.tensor([[math.log(1.25)]]), torch.zeros(1, 1), torch.ones(1, 1)
    loss, stats = policy_loss(logp, old, adv, torch.ones(1, 1), clip_eps=0.2)
    close(loss, -1.2)
    assert stats["clipfrac"] == 1.0
    loss, stats = policy_loss(logp, old, adv, torch.ones(1, 1), clip_eps=0.2, clip_eps_high=0.28)
    close(loss, -1.25)  # 1.25 < 1.28: unclipped
    assert stats["clipfrac"] == 0.0
    # the lower bound stays at 1 - 0.2: r 0.5 with A -1 is clipped to -0.8
    low, _ = policy_loss(torch.tensor([[LN_0_5]]), old, -adv, torch.ones(1, 1), 0.2, clip_eps_high=0.28)
    close(low, 0.8)


def test_policy_loss_padding_garbage_changes_nothing():
    logp, old, adv = _clip_case()
    ref_loss, ref_stats = policy_loss(logp, old, adv, torch.ones(1, 4), clip_eps=0.2)
    padded_logp = torch.cat([logp.detach(), torch.tensor([[-math.inf, 30.0]])], 1).requires_grad_()
    padded_old = torch.cat([old, torch.tensor([[0.0, -30.0]])], 1)
    padded_adv = torch.cat([adv, torch.tensor([[1e6, math.nan]])], 1)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    loss, stats = policy_loss(padded_logp, padded_old, padded_adv, mask, clip_eps=0.2)
    close(loss, ref_loss.item())
    assert stats == pytest.approx(ref_stats)
    loss.backward()
    close(padded_logp.grad, [[0.0, 1.5 / 4, 0.0, -0.5 / 4, 0.0, 0.0]])


def test_policy_loss_rejects_non_positive_eps():
    with pytest.raises(ValueError, match="clip_eps"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), clip_eps=0.0)


# --- value loss ------------------------------------------------------------------------------------------


def test_value_loss_by_hand():
    # eps = 0.2, old 0.5 everywhere, so v is clipped to [0.3, 0.7]; return 1.0 everywhere
    # t0: v 1.0 -> (1.0-1)^2 = 0,    clipped 0.7: 0.09 -> max 0.09 (clipped term wins)
    # t1: v 0.6 -> 0.16,             clipped 0.6: 0.16 -> 0.16 (no clipping)
    # t2: v 0.0 -> 1.0,              clipped 0.3: 0.49 -> 1.0
    # padding t3 holds garbage
    value = torch.tensor([[1.0, 0.6, 0.0, 40.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5, -40.0]])
    ret = torch.tensor([[1.0, 1.0, 1.0, math.inf]])
    loss, stats = value_loss(value, old, ret, torch.tensor([[1, 1, 1, 0]]), clip_eps=0.2)
    close(loss, 0.5 * (0.09 + 0.16 + 1.0) / 3)
    assert stats["vf_clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    # d/dv 0.5*(v-R)^2/3 = (v-R)/3 where the unclipped term is used; 0 where the clipped one saturates
    close(value.grad, [[0.0, -0.4 / 3, -1.0 / 3, 0.0]])


# --- entropy ---------------------------------------------------------------------------------------------


def test_entropy_from_logits_by_hand():
    logits = torch.stack(
        [
            torch.zeros(4),  # uniform over 4: ln 4
            torch.log(torch.tensor([0.5, 0.25, 0.25, 1e-30])) + 7.0,  # shift-invariant: ~1.5 ln 2
        ]
    ).unsqueeze(0)
    # second row: 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2
    close(entropy_from_logits(logits), [[math.log(4.0), 1.5 * LN2]])


def test_entropy_with_filtered_tokens_is_finite_with_gradient():
    logits = torch.tensor([[[0.0, 0.0, -math.inf], [5.0, -math.inf, -math.inf]]], requires_grad=True)
    ent = entropy_from_logits(logits)
    close(ent, [[LN2, 0.0]])  # two equal tokens; one certain token
    ent.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_entropy_gradient_pushes_towards_uniform():
    logits = torch.tensor([[[1.0, 0.0]]], requires_grad=True)
    entropy_from_logits(logits).sum().backward()
    assert logits.grad[0, 0, 0] < 0 < logits.grad[0, 0, 1]


# --- Bradley-Terry ---------------------------------------------------------------------------------------


def test_bradley_terry_loss_by_hand():
    chosen = torch.tensor([2.0, 0.0], requires_grad=True)
    rejected = torch.tensor([0.0, 1.0])
    # margins [2, -1]: -logsigmoid(2) = ln(1 + e^-2), -logsigmoid(-1) = ln(1 + e)
    loss, accuracy = bradley_terry_loss(chosen, rejected)
    close(loss, (math.log1p(math.exp(-2.0)) + math.log1p(math.e)) / 2)
    assert accuracy == 0.5
    loss.backward()
    # d/dchosen = -sigmoid(-margin) / 2
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    close(chosen.grad, [-sig(-2.0) / 2, -sig(1.0) / 2])


def test_bradley_terry_counts_ties_as_wrong():
    _, accuracy = bradley_terry_loss(torch.tensor([1.0, 1.0, 3.0]), torch.tensor([1.0, 0.0, 0.0]))
    assert accuracy == pytest.approx(2 / 3)
