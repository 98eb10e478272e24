"""The training-inference mismatch figures and the masking off-policy corrections (``mis``, ``geo_reject``) against
values worked out by hand, and the mismatch measured in runs on the reference executor from either source: the
trainer's recomputed log-probs, or the actor's first optimizer step. That the Ray runtime reports the same figures
and corrections is checked by the equivalence suites (tests/test_runtime.py, tests/test_async.py)."""

import math

import pytest
import torch

from loomrl.algorithms import losses as L
from loomrl.algorithms import workflows
from loomrl.algorithms.mismatch import MISMATCH_SUMS, mismatch_metrics, mismatch_sums
from loomrl.config.schema import TrainConfig
from loomrl.config.tools import load_config
from loomrl.errors import ConfigError
from loomrl.train.rl import RLTrainer
from loomrl.workflow.batch import response_tokens
from loomrl.workflow.minibatches import minibatch_steps
from test_rl import spy_on_iterations, tiny_cfg

FIGURES = ("mean_abs_logp_diff", "token_mult_prob_error", "k3_kl", "ess")

# trainer / behaviour probabilities 0.5/0.5, 0.9/0.3, 0.2/0.4 and a padded token holding garbage
TRAINER = torch.log(torch.tensor([[0.5, 0.9, 0.2, 1e-30]]))
BEHAV = torch.log(torch.tensor([[0.5, 0.3, 0.4, 0.0]]))
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])


# ------------------------------------------------------------------------------------------------- mismatch
def test_mismatch_figures_by_hand():
    """d = (0, ln 3, -ln 2), w = (1, 3, 1/2): mean |d| = ln 6 / 3, mean exp|d| = (1 + 3 + 2) / 3, k3 = mean(w - 1 - d)
    = (0 + 2 - ln 3 - 1/2 + ln 2) / 3, ESS = 4.5^2 / (3 * (1 + 9 + 1/4))."""
    got = mismatch_metrics(mismatch_sums(TRAINER, BEHAV, MASK))
    assert got["mismatch/tokens"] == 3
    assert got["mismatch/mean_abs_logp_diff"] == pytest.approx(math.log(6) / 3, rel=1e-6)
    assert got["mismatch/token_mult_prob_error"] == pytest.approx(2.0, rel=1e-6)
    assert got["mismatch/k3_kl"] == pytest.approx((1.5 - math.log(1.5)) / 3, rel=1e-6)
    assert got["mismatch/ess"] == pytest.approx(4.5**2 / (3 * 10.25), rel=1e-6)
    assert not any(k in got for k in MISMATCH_SUMS[1:])  # the sums give way to the figures


def test_mismatch_of_equal_log_probs_is_none():
    got = mismatch_metrics(mismatch_sums(TRAINER, TRAINER, MASK))
    assert [got[f"mismatch/{k}"] for k in FIGURES] == [0.0, 1.0, 0.0, 1.0]


def test_mismatch_sums_of_parts_add_up_to_the_whole():
    """What data-parallel ranks and controllers do: each reports its rows' sums, the sums are added."""
    torch.manual_seed(0)
    trainer, behav = torch.randn(6, 5), torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    whole = mismatch_metrics(mismatch_sums(trainer, behav, mask))
    parts = [mismatch_sums(trainer[rows], behav[rows], mask[rows]) for rows in (slice(0, 1), slice(1, 4), slice(4, 6))]
    added = {k: sum(p[k] for p in parts) for k in MISMATCH_SUMS}
    got = mismatch_metrics(added)
    assert got.keys() == whole.keys()
    for key, value in whole.items():
        assert got[key] == pytest.approx(value, rel=1e-12)


def test_mismatch_metrics_leave_other_statistics_and_say_nothing_over_no_tokens():
    assert mismatch_metrics({"actor/pg_loss": 0.5}) == {"actor/pg_loss": 0.5}
    empty = mismatch_sums(TRAINER, BEHAV, torch.zeros_like(MASK))
    assert mismatch_metrics({**empty, "x": 1.0}) == {"x": 1.0, "mismatch/tokens": 0.0}


# ------------------------------------------------------------------------------------------- corrections
def test_masked_importance_sampling_leaves_out_tokens_outside_the_band():
    """w = (1, 3, 1/2): with the band [0.6, 2] the second (above) and third (below) are left out; with [0.4, 2] the
    third is kept with its weight."""
    w, stats = L.behaviour_weights(TRAINER, BEHAV, MASK, "mis", cap=2.0, low=0.6)
    assert torch.allclose(w[:, :3], torch.tensor([[1.0, 0.0, 0.0]]))
    assert stats["is_dropped"] == pytest.approx(2 / 3) and "is_capped" not in stats
    assert stats["is_weight"] == pytest.approx(4.5 / 3)
    w, stats = L.behaviour_weights(TRAINER, BEHAV, MASK, "mis", cap=2.0, low=0.4)
    assert torch.allclose(w[:, :3], torch.tensor([[1.0, 0.0, 0.5]]))
    assert stats["is_dropped"] == pytest.approx(1 / 3)


def test_geometric_rejection_leaves_out_whole_responses_outside_the_band():
    """Response 0 has w = (1, 3, 1/2): geometric mean 1.5^(1/3) ≈ 1.14, kept, every token weighing 1; response 1 has
    w = (3, 3): geometric mean 3, left out whole. Dropped: 2 of 5 tokens, 1 of 2 responses."""
    prox = torch.log(torch.tensor([[0.5, 0.9, 0.2], [0.9, 0.9, 1e-30]]))
    behav = torch.log(torch.tensor([[0.5, 0.3, 0.4], [0.3, 0.3, 0.0]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert torch.allclose(L.geometric_ratio(prox, behav, mask), torch.tensor([1.5 ** (1 / 3), 3.0]))
    assert L.geometric_rejected(prox, behav, mask, 0.5, 2.0).tolist() == [False, True]
    assert L.geometric_rejected(prox, behav, mask, 1.2, 4.0).tolist() == [True, False]
    w, stats = L.behaviour_weights(prox, behav, mask, "geo_reject", cap=2.0, low=0.5)
    assert torch.equal(w * mask, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert stats["is_dropped"] == pytest.approx(2 / 5) and stats["is_weight"] == pytest.approx(10.5 / 5)
    _, per_response = L.behaviour_weights(prox, behav, mask, "geo_reject", 2.0, "seq-mean-token-mean", 0.5)
    assert per_response["is_dropped"] == pytest.approx(1 / 2)
    kept, _ = L.behaviour_weights(prox, behav, mask, "geo_reject", cap=4.0, low=0.5)
    assert torch.equal(kept * mask, mask)


@pytest.mark.parametrize("kind", ["mis", "geo_reject"])
def test_a_band_whose_low_end_is_not_below_its_cap_is_a_one_line_error(kind):
    with pytest.raises(ConfigError, match=r"algo.is_low: 2.0 must be below is_cap \(2.0\)") as err:
        load_config(TrainConfig, None, [f"algo.off_policy={kind}", "algo.is_low=2", "algo.is_cap=2"])
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"algo.off_policy.*geo_reject"):
        load_config(TrainConfig, None, ["algo.off_policy=icepop"])


# ---------------------------------------------------------------------------------------------------- runs
def _shifted_generation(monkeypatch, shift_of_token):
    """Generation whose behaviour log-probs are its own plus ``shift_of_token(t)`` at response token t: a known
    mismatch for the trainer to find."""
    generate = workflows.generate_op

    def shifted(ctx, batch, params, **options):
        out = generate(ctx, batch, params, **options)
        if "logp" in out:
            shift_R = torch.tensor([shift_of_token(t) for t in range(out["logp"].shape[1])])
            out["logp"] = out["logp"] + shift_R * out["mask"]
        return out

    monkeypatch.setattr(workflows, "generate_op", shifted)


@pytest.mark.parametrize("recompute", [False, True], ids=["first_step", "recomputed"])
def test_a_run_measures_a_known_mismatch(tmp_path, monkeypatch, recompute):
    """Behaviour log-probs shifted by +0.2 on even tokens and -0.1 on odd ones: the trainer's log-probs differ from
    them by d = -0.2 and +0.1 (to float precision). Without a recomputation the figures are over the first
    minibatch's tokens (the only one before an update), with one over every token of the batch."""
    _shifted_generation(monkeypatch, lambda t: 0.2 if t % 2 == 0 else -0.1)
    extra = ("algo.recompute_logprobs=true",) if recompute else ()
    trainer = RLTrainer(tiny_cfg(tmp_path, "algo.name=ppo", "algo.ppo_epochs=2", *extra))
    results = spy_on_iterations(trainer, monkeypatch)
    metrics = trainer.run()
    batch, iteration = results[-1].batch, len(results) - 1
    tokens = response_tokens(batch)
    first = minibatch_steps(tokens, 2, trainer.cfg.algo.minibatches, trainer.cfg.seed, iteration)[0]
    measured = list(range(len(batch))) if recompute else list(first.rows_per_rank[0])
    assert metrics["mismatch/tokens"] == sum(tokens[r] for r in measured)
    assert recompute or metrics["mismatch/tokens"] < sum(tokens)
    mask = batch["mask"][measured]
    d = torch.where(torch.arange(mask.shape[1]) % 2 == 0, -0.2, 0.1).expand_as(mask)[mask.bool()].double()
    expected = mismatch_metrics(mismatch_sums(d, torch.zeros_like(d), torch.ones_like(d)))
    for key in FIGURES:
        assert metrics[f"mismatch/{key}"] == pytest.approx(expected[f"mismatch/{key}"], abs=1e-5), key
    assert metrics["mismatch/ess"] < 1 - 1e-3  # two different weights


@pytest.mark.parametrize("kind", ["mis", "geo_reject"])
def test_a_masking_correction_drops_what_leaves_its_band(tmp_path, monkeypatch, kind):
    """Behaviour log-probs 0.3 above the trainer's on the first response token (w = e^-0.3 ≈ 0.74) and equal after:
    with the band [0.8, 2] 'mis' drops every first token, 'geo_reject' every response of one token (its geometric
    mean is 0.74) and keeps the longer ones (e^(-0.3/n) >= 0.86 for n >= 2)."""
    _shifted_generation(monkeypatch, lambda t: 0.3 if t == 0 else 0.0)
    trainer = RLTrainer(
        tiny_cfg(tmp_path, "algo.name=grpo", f"algo.off_policy={kind}", "algo.is_low=0.8", "algo.ppo_epochs=2")
    )
    results = spy_on_iterations(trainer, monkeypatch)
    metrics = trainer.run()
    batch = results[-1].batch
    lengths = torch.tensor(response_tokens(batch), dtype=torch.float)
    if kind == "mis":
        dropped = 1.0 / lengths  # one token of each response, as a fraction of its tokens
    else:
        dropped = (lengths == 1).float()
    steps = minibatch_steps(response_tokens(batch), 2, trainer.cfg.algo.minibatches, trainer.cfg.seed, 1)
    expected = sum(float((dropped * lengths)[list(s.rows_per_rank[0])].sum()) / s.tokens for s in steps) / len(steps)
    assert expected > 0  # this seed's last batch has a response of one token
    assert metrics["offpolicy/is_dropped"] == pytest.approx(expected, abs=1e-6)
    if kind == "geo_reject":  # each of the batch's responses counted once, whatever the epochs and minibatches
        assert metrics["offpolicy/responses_dropped"] == int((lengths == 1).sum())
    else:
        assert "offpolicy/responses_dropped" not in metrics
    assert metrics["mismatch/mean_abs_logp_diff"] == pytest.approx(0.3 * len(batch) / float(lengths.sum()), abs=1e-5)
