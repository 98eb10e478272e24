"""Advantage estimators against values worked out by hand; padding must never change a result."""

import math

import pytest
import torch

from loomrl.algorithms.advantages import (
    broadcast_to_tokens,
    credit_by_turn,
    discounted_returns,
    gae,
    group_normalized,
    group_scale,
    masked_mean,
    masked_var,
    masked_whiten,
    reinforce_pp_advantage,
    remax_advantage,
    rloo_baseline,
    token_rewards,
)

NAN, INF = float("nan"), float("inf")


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# --- masked statistics -----------------------------------------------------------------------------------


def test_masked_mean_ignores_padding_even_nan_and_inf():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, NAN, INF]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(masked_mean(x, mask), 2.0)  # (1 + 2 + 3) / 3
    close(masked_mean(x, mask, dim=1), [1.5, 3.0])
    close(masked_mean(x, mask.bool(), dim=1), [1.5, 3.0])  # bool and int masks agree


def test_masked_mean_along_dim_gives_zero_for_empty_row():
    x = torch.tensor([[1.0, 3.0], [5.0, 7.0]])
    close(masked_mean(x, torch.tensor([[1, 1], [0, 0]]), dim=1), [2.0, 0.0])


def test_masked_var_biased_and_unbiased():
    x = torch.tensor([[1.0, 2.0, -50.0], [3.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # real values 1, 2, 3: mean 2, squared deviations 1 + 0 + 1 = 2
    close(masked_var(x, mask), 1.0)  # 2 / (3 - 1)
    close(masked_var(x, mask, unbiased=False), 2.0 / 3.0)  # 2 / 3


def test_masked_var_needs_two_elements_when_unbiased():
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(torch.tensor([[4.0, 5.0]]), torch.tensor([[1, 0]]))


def test_masked_whiten_with_and_without_mean_shift():
    x = torch.tensor([[2.0, 4.0], [6.0, 1000.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # real values 2, 4, 6: mean 4, unbiased var (4 + 0 + 4) / 2 = 4, std 2
    close(masked_whiten(x, mask), [[-1.0, 0.0], [1.0, 0.0]])
    close(masked_whiten(x, mask, shift_mean=False), [[3.0, 4.0], [5.0, 0.0]])  # (x - 4) / 2 + 4


# --- PPO token rewards and GAE ---------------------------------------------------------------------------


def test_token_rewards_puts_score_on_last_real_token():
    score = torch.tensor([1.0, 2.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 9.0, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # row 0: -0.5 * [0.1, 0.2, 0.3] = [-0.05, -0.1, -0.15], +1 on token 2
    # row 1: -0.5 * 0.5 = -0.25, +2 on token 0; padding stays 0 despite kl there
    close(token_rewards(score, kl, mask, kl_coef=0.5), [[-0.05, -0.1, 0.85], [1.75, 0.0, 0.0]])


def test_token_rewards_row_without_tokens_gets_nothing():
    reward = token_rewards(torch.tensor([3.0]), torch.zeros(1, 2), torch.zeros(1, 2), kl_coef=0.1)
    close(reward, [[0.0, 0.0]])


def test_gae_one_row_by_hand():
    reward = torch.tensor([[0.1, -0.2, 1.0]])
    value = torch.tensor([[0.5, 0.4, 0.6]])
    # gamma = 0.9, lam = 0.8, so gamma * lam = 0.72; the value after the last token is 0
    # t=2: delta = 1.0 + 0.9*0   - 0.6 =  0.4;   A2 = 0.4
    # t=1: delta = -0.2 + 0.9*0.6 - 0.4 = -0.06;  A1 = -0.06 + 0.72*0.4   = 0.228
    # t=0: delta = 0.1 + 0.9*0.4 - 0.5 = -0.04;  A0 = -0.04 + 0.72*0.228 = 0.12416
    adv, ret = gae(reward, value, torch.ones(1, 3), gamma=0.9, lam=0.8)
    close(adv, [[0.12416, 0.228, 0.4]])
    close(ret, [[0.62416, 0.628, 1.0]])  # adv + value


def test_gae_with_gamma_lam_one_is_reward_to_go_minus_value():
    reward = torch.tensor([[0.0, 0.0, 1.0]])
    value = torch.tensor([[0.2, 0.5, 0.7]])
    adv, ret = gae(reward, value, torch.ones(1, 3), gamma=1.0, lam=1.0)
    close(adv, [[0.8, 0.5, 0.3]])  # 1 - V_t
    close(ret, [[1.0, 1.0, 1.0]])


def test_gae_padding_does_not_change_real_tokens():
    reward = torch.tensor([[0.1, -0.2, 1.0, 0.0], [0.1, -0.2, 1.0, 5.0]])
    value = torch.tensor([[0.5, 0.4, 0.6, 0.0], [0.5, 0.4, 0.6, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    adv, ret = gae(reward, value, mask, gamma=0.9, lam=0.8)
    # both rows equal the hand-worked 1x3 case; the garbage 5.0 / 7.0 in row 1's padding is ignored
    close(adv, [[0.12416, 0.228, 0.4, 0.0]] * 2)
    close(ret, [[0.62416, 0.628, 1.0, 0.0]] * 2)


def test_gae_rows_of_different_lengths():
    reward = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    value = torch.tensor([[0.5, 0.5], [1.0, 3.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # row 0, gamma = 0.5, lam = 1: A1 = 1 - 0.5 = 0.5; A0 = (0 + 0.5*0.5 - 0.5) + 0.5*0.5 = 0
    # row 1 ends after token 0: A0 = 2 - 1 = 1 (its padded value 3.0 must not be bootstrapped)
    adv, ret = gae(reward, value, mask, gamma=0.5, lam=1.0)
    close(adv, [[0.0, 0.5], [1.0, 0.0]])
    close(ret, [[0.5, 1.0], [2.0, 0.0]])


def test_discounted_returns_by_hand():
    reward = torch.tensor([[1.0, 2.0, 3.0], [4.0, 8.0, 8.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # row 0, gamma 0.5: G2 = 3; G1 = 2 + 0.5*3 = 3.5; G0 = 1 + 0.5*3.5 = 2.75; row 1: padding ignored
    close(discounted_returns(reward, mask, gamma=0.5), [[2.75, 3.5, 3.0], [4.0, 0.0, 0.0]])


# --- group baselines -------------------------------------------------------------------------------------


def test_group_normalized_grpo():
    score = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 6.0])
    # group 0: mean 2, unbiased std 1            -> [-1, 0, 1]
    # group 1: mean 2, deviations [-2, -2, 4], var (4 + 4 + 16) / 2 = 12, std sqrt(12)
    s = math.sqrt(12.0)
    close(group_normalized(score, 3, eps=0.0), [-1.0, 0.0, 1.0, -2 / s, -2 / s, 4 / s])


def test_group_normalized_dr_grpo_only_centres():
    score = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 6.0])
    close(group_normalized(score, 3, std_normalize=False), [-1.0, 0.0, 1.0, -2.0, -2.0, 4.0])


def test_group_normalized_equal_scores_give_zero_not_nan():
    close(group_normalized(torch.tensor([5.0, 5.0]), 2), [0.0, 0.0])


def test_group_normalized_rejects_ragged_batch():
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        group_normalized(torch.zeros(6), 4)


def test_rloo_leaves_one_out():
    score = torch.tensor([1.0, 2.0, 3.0, 7.0, 4.0, 1.0])
    # group [1, 2, 3]: 1 - (2+3)/2 = -1.5, 2 - (1+3)/2 = 0, 3 - (1+2)/2 = 1.5
    # group [7, 4, 1]: 7 - 2.5 = 4.5, 4 - 4 = 0, 1 - 5.5 = -4.5
    close(rloo_baseline(score, 3), [-1.5, 0.0, 1.5, 4.5, 0.0, -4.5])
    close(rloo_baseline(torch.tensor([1.0, 3.0, 10.0, 0.0]), 2), [-2.0, 2.0, 10.0, -10.0])


def test_rloo_needs_two_samples_per_group():
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo_baseline(torch.zeros(3), 1)


def test_remax_subtracts_greedy_score():
    close(remax_advantage(torch.tensor([1.0, 0.5, -1.0]), torch.tensor([0.5, 0.5, 1.0])), [0.5, 0.0, -2.0])
    with pytest.raises(ValueError, match="equal shape"):
        remax_advantage(torch.zeros(2), torch.zeros(3))


def test_broadcast_to_tokens_zeroes_padding():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask), [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])


# --- REINFORCE++ -----------------------------------------------------------------------------------------


def test_reinforce_pp_by_hand():
    score = torch.tensor([1.0, 0.0])
    kl = torch.tensor([[0.5, 0.5], [1.0, 123.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # rewards (kl_coef 0.2): row 0 [-0.1, -0.1 + 1 = 0.9], row 1 [-0.2 + 0]
    # returns (gamma 0.5):   row 0 [-0.1 + 0.5*0.9 = 0.35, 0.9], row 1 [-0.2]
    # whiten over the 3 real tokens: mean 0.35, deviations [0, 0.55, -0.55], unbiased var 0.3025, std 0.55
    adv = reinforce_pp_advantage(score, kl, mask, kl_coef=0.2, gamma=0.5)
    close(adv, [[0.0, 1.0], [-1.0, 0.0]])


@pytest.mark.parametrize("fn", ["gae", "discounted_returns"])
def test_masked_tokens_inside_a_row_are_skipped_as_if_absent(fn):
    # an episode's observation tokens (mask 0 between sampled ones): the recursion passes over them, giving the
    # sampled tokens what the same row without them would get, and the observation tokens nothing
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1, 0, 0], [1, 0, 1, 1, 1, 0, 0, 0, 0, 0]])
    reward, value = torch.randn(2, 10), torch.randn(2, 10)
    reward[mask == 0] = float("nan")  # whatever sits at a masked token never counts
    value[mask == 0] = float("inf")
    run = (
        (lambda r, v, m: gae(r, v, m, 0.9, 0.8)) if fn == "gae" else (lambda r, v, m: (discounted_returns(r, m, 0.9),))
    )
    got = run(reward, value, mask)
    for b in range(2):
        keep = mask[b] == 1
        alone = run(reward[b : b + 1, keep], value[b : b + 1, keep], torch.ones(1, int(keep.sum())))
        for g, a in zip(got, alone):
            assert torch.allclose(g[b, keep], a[0]) and (g[b, ~keep] == 0).all()


# --- turn credit (multi-turn episodes) --------------------------------------------------------------------


def test_earned_rewards_stay_where_they_were_earned_and_the_rest_of_the_score_goes_last():
    mask = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.float32)
    earned = torch.tensor([[0, 0.3, 0, 0, 0.5, 0], [0, 0, 0, 0, 0, 0]])
    kl = torch.full((2, 6), 0.1)
    got = token_rewards(torch.tensor([0.6, 2.0]), kl, mask, 0.5, earned)  # row 0: 0.8 earned, -0.2 shaped away
    close(got, [[-0.05, 0.25, 0, -0.05, 0.25, 0], [1.95, 0, 0, 0, 0, 0]])
    plain = token_rewards(torch.tensor([0.6, 2.0]), kl, mask, 0.5)
    assert torch.equal(token_rewards(torch.tensor([0.6, 2.0]), kl, mask, 0.5, torch.zeros(2, 6)), plain)


def test_turn_credit_takes_from_a_turn_what_earlier_turns_earned():
    mask = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 1, 0, 1, 0, 0]], dtype=torch.float32)
    earned = torch.tensor([[0, 0.3, 0, 0, 0.7, 0], [0, 0, 0, 0, 0, 0]])  # row 1: everything at the end
    adv = torch.tensor([2.0, -1.0])
    got = credit_by_turn(adv, torch.tensor([1.0, 0.4]), earned, mask, torch.tensor([0.5, 3.0]))
    close(got, [[2.0, 2.0, 0, 1.85, 1.85, 0], [-1.0, -1.0, 0, -1.0, 0, 0]])
    end_only = credit_by_turn(adv, torch.tensor([1.0, 0.4]), torch.zeros(2, 6), mask, torch.tensor([0.5, 3.0]))
    assert torch.equal(end_only, broadcast_to_tokens(adv, mask)), "rewarded at the end: the episode rule exactly"
    score = torch.tensor([1.0, 3.0, 2.0, 6.0])
    close(group_scale(score, 2), [1 / (math.sqrt(2) + 1e-6)] * 2 + [1 / (math.sqrt(8) + 1e-6)] * 2)
    close(group_normalized(score, 2), (score - torch.tensor([2.0, 2.0, 4.0, 4.0])) * group_scale(score, 2))
