"""Train schedules: the same optimizer steps on the same samples for any number of data-parallel ranks."""

import pytest

from loomrl.workflow.minibatches import minibatch_steps, split_by_tokens

TOKENS = [5, 1, 7, 3, 3, 9, 2, 4, 6, 8, 1, 2]


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_every_step_covers_its_minibatch_once_across_ranks(dp):
    ref = minibatch_steps(TOKENS, epochs=2, minibatches=3, seed=0, iteration=5)
    sched = minibatch_steps(TOKENS, epochs=2, minibatches=3, seed=0, iteration=5, dp=dp)
    assert len(sched) == len(ref) == 6
    for step, ref_step in zip(sched, ref):
        rows = [r for part in step.rows_per_rank for r in part]
        assert sorted(rows) == sorted(ref_step.rows_per_rank[0]), "same samples as the single-rank step"
        assert len(step.rows_per_rank) == dp and step.tokens == ref_step.tokens
        weights = [step.local(d, TOKENS)[1] for d in range(dp)]
        assert sum(weights) == pytest.approx(1.0)
    for epoch in (0, 1):  # each epoch visits every sample exactly once
        rows = sorted(r for s in sched if s.epoch == epoch for part in s.rows_per_rank for r in part)
        assert rows == list(range(len(TOKENS)))


def test_schedule_is_seeded():
    a = minibatch_steps(TOKENS, 1, 2, seed=0, iteration=0)
    assert a == minibatch_steps(TOKENS, 1, 2, seed=0, iteration=0)
    assert a != minibatch_steps(TOKENS, 1, 2, seed=0, iteration=1)
    assert a != minibatch_steps(TOKENS, 1, 2, seed=1, iteration=0)


def test_split_by_tokens_balances_and_keeps_order():
    parts = split_by_tokens([0, 1, 2, 3, 4, 5], [10, 1, 1, 1, 1, 6], 2)
    loads = [sum([10, 1, 1, 1, 1, 6][r] for r in p) for p in parts]
    assert sorted(loads) == [10, 10]
    assert all(list(p) == sorted(p) for p in parts)
    assert split_by_tokens([3, 1], [1, 1, 1, 1], 4) == ((1,), (3,), (), ())  # ties go to the lower row first
