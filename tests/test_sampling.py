"""Per-sample random streams and the token sampler: noise as a pure function, Gumbel-max frequencies, filters,
the blockwise maximum."""

from __future__ import annotations

import math

import pytest
import torch

from loomrl.rollout.sampling import SamplingParams, filter_logits, sample_tokens, stream_keys, uniform_noise

KEY_SEED0_IT0_ID0 = 4808561972376111626
"""stream_keys(0, 0, [0]), computed once; a change means every recorded run draws different tokens."""

# A (key, step, vocabulary index) whose 24 hash bits are all ones, found by a one-off search over the stream
# of stream_keys(0, 0, [0]); used to show that the top of the uniform's range rounds to exactly 1.0.
ALL_ONES_STEP, ALL_ONES_INDEX = 1_565_766, 4


def _keys(n: int, seed: int = 0, iteration: int = 0) -> torch.Tensor:
    return stream_keys(seed, iteration, range(n))


def _steps(n: int, step: int = 0) -> torch.Tensor:
    return torch.full((n,), step, dtype=torch.int64)


def _frequencies(tokens_B: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens_B, minlength=vocab).double() / tokens_B.numel()


def _assert_matches(freq_V: torch.Tensor, probs_V: torch.Tensor, n: int) -> None:
    """Each frequency within 5 binomial standard deviations (plus a hair) of its probability, and chi² sane."""
    probs_V = probs_V.double()
    sd_V = (probs_V * (1 - probs_V) / n).sqrt()
    assert torch.all((freq_V - probs_V).abs() <= 5 * sd_V + 1e-9), (freq_V, probs_V)
    support = probs_V > 0
    chi2 = (n * (freq_V[support] - probs_V[support]) ** 2 / probs_V[support]).sum().item()
    dof = int(support.sum()) - 1
    # The 0.999 quantile of chi² with <= 9 degrees of freedom is below 28; this is a loose bound.
    assert chi2 < 3 * dof + 20, chi2


# ---------------------------------------------------------------------------------------------- uniform_noise


def test_uniform_noise_shape_dtype_range_and_determinism():
    keys_B, steps_B = _keys(256), torch.arange(256)
    u_BV = uniform_noise(keys_B, steps_B, 48)
    assert u_BV.shape == (256, 48) and u_BV.dtype == torch.float32
    assert float(u_BV.min()) > 0.0 and float(u_BV.max()) < 1.0
    assert torch.equal(u_BV, uniform_noise(keys_B.clone(), steps_B.clone(), 48))


def test_uniform_noise_row_does_not_depend_on_batch_or_order():
    keys_B = _keys(64, seed=3, iteration=2)
    steps_B = torch.arange(64) * 7 % 11
    batch_BV = uniform_noise(keys_B, steps_B, 48)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    permuted_BV = uniform_noise(keys_B[perm], steps_B[perm], 48)
    assert torch.equal(permuted_BV, batch_BV[perm])
    for b in (0, 17, 63):
        alone_1V = uniform_noise(keys_B[b : b + 1], steps_B[b : b + 1], 48)
        assert torch.equal(alone_1V[0], batch_BV[b])


def test_uniform_noise_depends_on_vocab_index_not_vocab_size():
    keys_B, steps_B = _keys(8), torch.arange(8)
    assert torch.equal(uniform_noise(keys_B, steps_B, 10), uniform_noise(keys_B, steps_B, 48)[:, :10])


def test_uniform_noise_steps_keys_and_indices_differ():
    key_1 = _keys(1)
    by_step_SV = torch.cat([uniform_noise(key_1, torch.tensor([s]), 48) for s in range(20)])
    assert len({tuple(row.tolist()) for row in by_step_SV}) == 20
    by_key_BV = uniform_noise(_keys(20), _steps(20), 48)
    assert len({tuple(row.tolist()) for row in by_key_BV}) == 20
    # Within one row the 48 values are (almost surely) all distinct: the vocabulary index is mixed in.
    assert len(set(by_key_BV[0].tolist())) == 48
    # Step 0 and step 1 of one key are not a shifted copy of each other.
    assert not torch.equal(by_step_SV[0, 1:], by_step_SV[1, :-1])


def test_uniform_noise_is_roughly_uniform():
    u = uniform_noise(_keys(2000, seed=5), torch.arange(2000) % 13, 50).flatten().double()
    n = u.numel()
    assert n == 100_000
    assert abs(u.mean().item() - 0.5) < 0.005  # sd of the mean is 0.0009
    assert abs(u.var().item() - 1 / 12) < 0.002
    # Kolmogorov–Smirnov distance to U(0,1); the 0.999 critical value for n = 1e5 is 0.0062.
    sorted_u = u.sort().values
    i = torch.arange(1, n + 1, dtype=torch.float64)
    ks = torch.maximum(i / n - sorted_u, sorted_u - (i - 1) / n).max().item()
    assert ks < 0.01, ks
    # Neighbouring vocabulary columns and neighbouring steps are uncorrelated.
    grid_BV = uniform_noise(_keys(2000, seed=5), torch.arange(2000) % 13, 50).double()
    cols = torch.corrcoef(torch.stack([grid_BV[:, :-1].flatten(), grid_BV[:, 1:].flatten()]))[0, 1].item()
    assert abs(cols) < 0.02, cols
    key_1 = _keys(1)
    by_step = uniform_noise(key_1.expand(4000), torch.arange(4000), 1)[:, 0].double()
    lag1 = torch.corrcoef(torch.stack([by_step[:-1], by_step[1:]]))[0, 1].item()
    assert abs(lag1) < 0.06, lag1


def test_uniform_noise_never_reaches_one():
    u_1V = uniform_noise(_keys(1), torch.tensor([ALL_ONES_STEP]), ALL_ONES_INDEX + 1)
    assert float(u_1V.max()) < 1.0, u_1V


def test_sampler_never_picks_a_filtered_token_even_at_extreme_noise():
    logits_1V = torch.tensor([[5.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    tok_B, logp_B = sample_tokens(
        logits_1V, _keys(1), torch.tensor([ALL_ONES_STEP]), SamplingParams(temperature=1.0, top_k=2)
    )
    assert int(tok_B) in (0, 1), (tok_B, logp_B)
    assert math.isfinite(float(logp_B))


# ---------------------------------------------------------------------------------------------- stream_keys


def test_stream_keys_known_value_and_stability():
    keys = stream_keys(0, 0, [0])
    assert keys.dtype == torch.int64 and keys.shape == (1,)
    assert keys.tolist() == [KEY_SEED0_IT0_ID0]
    assert torch.equal(stream_keys(0, 0, [0, 1, 2]), stream_keys(0, 0, [0, 1, 2]))
    # A key depends on its own sample id only, not on the other ids asked for or their order.
    assert stream_keys(0, 0, [5, 0, 9]).tolist() == [
        *stream_keys(0, 0, [5]).tolist(),
        KEY_SEED0_IT0_ID0,
        *stream_keys(0, 0, [9]).tolist(),
    ]


def test_stream_keys_distinct_and_non_negative():
    keys = torch.cat([stream_keys(seed, it, range(100)) for seed in range(5) for it in range(5)])
    assert len(set(keys.tolist())) == keys.numel() == 2500
    assert bool((keys >= 0).all())
    # The separator keeps (1, 23) and (12, 3) apart; so are seed and iteration not interchangeable.
    assert stream_keys(1, 23, [4]).item() != stream_keys(12, 3, [4]).item()
    assert stream_keys(1, 2, [4]).item() != stream_keys(2, 1, [4]).item()
    assert stream_keys(0, 0, [1]).item() != stream_keys(0, 1, [0]).item()


# ---------------------------------------------------------------------------------------------- sample_tokens

PROBS_5 = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])


def test_greedy_is_argmax_with_unscaled_logp():
    logits_BV = torch.randn(32, 48, generator=torch.Generator().manual_seed(1)) * 3
    tok_B, logp_B = sample_tokens(logits_BV, _keys(32), _steps(32), SamplingParams(temperature=0.0))
    assert torch.equal(tok_B, logits_BV.argmax(-1))
    expected_B = torch.log_softmax(logits_BV, -1).gather(-1, tok_B[:, None]).squeeze(-1)
    torch.testing.assert_close(logp_B, expected_B)


def test_gumbel_max_frequencies_match_softmax():
    n = 20_000
    logits_BV = PROBS_5.log().expand(n, 5)
    tok_B, _ = sample_tokens(logits_BV, _keys(n), _steps(n), SamplingParams(temperature=1.0))
    _assert_matches(_frequencies(tok_B, 5), PROBS_5, n)
    # One stream over many steps draws from the same distribution.
    tok_B, _ = sample_tokens(logits_BV, _keys(1).expand(n), torch.arange(n), SamplingParams(temperature=1.0))
    _assert_matches(_frequencies(tok_B, 5), PROBS_5, n)


def test_temperature_sharpens_and_flattens():
    n = 20_000
    logits_BV = PROBS_5.log().expand(n, 5)
    tops = {}
    for temperature in (0.5, 1.0, 2.0):
        tok_B, _ = sample_tokens(logits_BV, _keys(n, seed=7), _steps(n), SamplingParams(temperature=temperature))
        freq_V = _frequencies(tok_B, 5)
        _assert_matches(freq_V, torch.softmax(PROBS_5.log() / temperature, -1), n)
        tops[temperature] = freq_V[0].item()
    assert tops[0.5] > tops[1.0] + 0.1 and tops[1.0] > tops[2.0] + 0.05, tops


def test_top_k_one_equals_greedy():
    logits_BV = torch.randn(500, 48, generator=torch.Generator().manual_seed(2))
    tok_B, logp_B = sample_tokens(logits_BV, _keys(500), _steps(500), SamplingParams(temperature=1.3, top_k=1))
    assert torch.equal(tok_B, logits_BV.argmax(-1))
    assert torch.equal(logp_B, torch.zeros(500))  # the only token left has probability one


def test_top_k_never_leaves_top_k_and_renormalises():
    n = 20_000
    logits_V = torch.tensor([0.3, 2.0, -1.0, 1.5, 0.9, 1.0, -0.2])
    tok_B, logp_B = sample_tokens(
        logits_V.expand(n, 7), _keys(n, seed=11), _steps(n), SamplingParams(temperature=1.0, top_k=3)
    )
    top3 = {1, 3, 5}
    assert set(tok_B.tolist()) == top3
    expected_V = torch.zeros(7)
    expected_V[[1, 3, 5]] = torch.softmax(logits_V[[1, 3, 5]], -1)
    _assert_matches(_frequencies(tok_B, 7), expected_V, n)
    torch.testing.assert_close(logp_B, expected_V.log()[tok_B])
    # top_k at least the vocabulary size, or 0, filters nothing.
    full_V = filter_logits(logits_V[None], 7, 1.0)[0]
    assert torch.equal(full_V, logits_V) and torch.equal(filter_logits(logits_V[None], 0, 1.0)[0], logits_V)


@pytest.mark.parametrize(
    "top_p, kept",
    [(0.4, [0]), (0.7, [0, 1]), (0.8, [0, 1, 2]), (0.95, [0, 1, 2, 3]), (1e-6, [0])],
)
def test_top_p_keeps_the_smallest_nucleus(top_p, kept):
    # Probabilities 0.5, 0.25, 0.15, 0.1 in a shuffled order: the nucleus is found by rank, not position.
    probs_V = torch.tensor([0.15, 0.5, 0.1, 0.25])
    rank_to_pos = [1, 3, 0, 2]
    filtered_V = filter_logits(probs_V.log()[None], 0, top_p)[0]
    kept_pos = sorted(rank_to_pos[r] for r in kept)
    assert torch.isfinite(filtered_V).nonzero().flatten().tolist() == kept_pos
    torch.testing.assert_close(filtered_V[kept_pos], probs_V.log()[kept_pos])


def test_top_p_always_keeps_the_top_token_and_samples_inside_the_nucleus():
    n = 5000
    peaked_V = torch.tensor([6.0, 0.0, 0.0, 0.0])  # top token has p ≈ 0.99 > top_p
    tok_B, logp_B = sample_tokens(peaked_V.expand(n, 4), _keys(n), _steps(n), SamplingParams(top_p=0.5))
    assert torch.equal(tok_B, torch.zeros(n, dtype=torch.long)) and torch.equal(logp_B, torch.zeros(n))
    probs_V = torch.tensor([0.5, 0.25, 0.15, 0.1])
    tok_B, logp_B = sample_tokens(probs_V.log().expand(n, 4), _keys(n, seed=2), _steps(n), SamplingParams(top_p=0.7))
    assert set(tok_B.tolist()) == {0, 1}
    _assert_matches(_frequencies(tok_B, 4), torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]), n)
    torch.testing.assert_close(logp_B, torch.tensor([2 / 3, 1 / 3]).log()[tok_B])


def test_filters_apply_after_temperature_and_top_p_after_top_k():
    n = 2000
    # Unscaled, top_p = 0.6 keeps {0, 1} (0.5 < 0.6); at T = 0.5 the top token alone has mass 0.658.
    probs_V = torch.tensor([0.5, 0.3, 0.2])
    tok_B, logp_B = sample_tokens(
        probs_V.log().expand(n, 3), _keys(n), _steps(n), SamplingParams(temperature=0.5, top_p=0.6)
    )
    assert set(tok_B.tolist()) == {0} and torch.equal(logp_B, torch.zeros(n))
    # top_p = 0.5 alone keeps {0, 1} of (0.4, 0.3, 0.2, 0.1); after top_k = 2 renormalises to (4/7, 3/7), {0}.
    logits_1V = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    assert torch.isfinite(filter_logits(logits_1V, 0, 0.5)).sum() == 2
    assert torch.isfinite(filter_logits(logits_1V, 2, 0.5)).flatten().tolist() == [True, False, False, False]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=10, top_p=0.6),
    ],
)
def test_logp_is_log_softmax_of_filtered_scaled_logits(params):
    logits_BV = torch.randn(64, 48, generator=torch.Generator().manual_seed(4)) * 2
    tok_B, logp_B = sample_tokens(logits_BV, _keys(64, seed=9), torch.arange(64), params)
    scaled_BV = logits_BV / params.temperature
    expected_logp_BV = torch.full_like(scaled_BV, float("-inf"))
    for b in range(64):  # the filters by hand: sort, keep top-k, then the smallest nucleus reaching top_p
        order = scaled_BV[b].argsort(descending=True).tolist()
        if params.top_k:
            order = order[: params.top_k]
        probs = torch.softmax(scaled_BV[b, order], -1).tolist()
        keep, mass = [], 0.0
        for pos, p in zip(order, probs):
            if mass >= params.top_p:
                break
            keep.append(pos)
            mass += p
        expected_logp_BV[b, keep] = torch.log_softmax(scaled_BV[b, keep], -1)
    assert torch.isfinite(expected_logp_BV.gather(-1, tok_B[:, None])).all()
    torch.testing.assert_close(logp_B, expected_logp_BV.gather(-1, tok_B[:, None]).squeeze(-1))


def test_sample_tokens_row_is_batch_invariant():
    logits_BV = torch.randn(16, 48, generator=torch.Generator().manual_seed(5))
    keys_B, steps_B = _keys(16, seed=1), torch.arange(16)
    params = SamplingParams(temperature=0.8, top_k=20)
    tok_B, logp_B = sample_tokens(logits_BV, keys_B, steps_B, params)
    perm = torch.arange(15, -1, -1)
    tok_perm_B, logp_perm_B = sample_tokens(logits_BV[perm], keys_B[perm], steps_B[perm], params)
    assert torch.equal(tok_perm_B, tok_B[perm]) and torch.equal(logp_perm_B, logp_B[perm])
    tok_1, _ = sample_tokens(logits_BV[3:4], keys_B[3:4], steps_B[3:4], params)
    assert tok_1.item() == tok_B[3].item()


@pytest.mark.parametrize("block_elements", [1, 37, 64 * 48, 1 << 19])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_blockwise_sampling_draws_exactly_the_whole_rows_gumbel_max(monkeypatch, block_elements, temperature):
    # Off CUDA the noise is hashed a block of columns at a time; every block size (one column, an uneven split, the
    # whole row) gives the token of logp + Gumbel noise maximised over the whole row.
    logits_BV = torch.randn(64, 48, generator=torch.Generator().manual_seed(8))
    logits_BV[:, 40:] = logits_BV[:, :8]  # equal logits in different blocks, told apart by their noise alone
    keys_B, steps_B = _keys(64, seed=4), torch.arange(64) % 5
    logp_BV = torch.log_softmax(logits_BV / temperature, -1)
    expected_B = (logp_BV + -torch.log(-torch.log(uniform_noise(keys_B, steps_B, 48)))).argmax(-1)
    monkeypatch.setattr("loomrl.rollout.sampling._BLOCK_ELEMENTS", block_elements)
    tok_B, logp_B = sample_tokens(logits_BV, keys_B, steps_B, SamplingParams(temperature=temperature))
    assert torch.equal(tok_B, expected_B)
    assert torch.equal(logp_B, logp_BV.gather(-1, expected_B[:, None]).squeeze(-1))
