"""The rollout engine: continuous batching, streaming, per-sample streams under any batching, abort/resubmit."""

import random

import pytest
import torch

from loomrl.models.tokenizer import build_char_tokenizer
from loomrl.models.zoo import build_causal_lm
from loomrl.rollout import GenerationBackend, Request, RolloutEngine, SamplingParams, length_stats, stream_keys

PARAMS = SamplingParams(max_new_tokens=24, temperature=1.0, top_k=0, top_p=0.95)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_causal_lm("llama-1m", build_char_tokenizer(), seed=3).eval()


def _requests(n: int, seed: int = 0, budgets=None) -> list[Request]:
    rng = random.Random(seed)
    keys = stream_keys(seed, 0, range(n)).tolist()
    return [
        Request(
            i,
            [1] + [rng.randint(4, 47) for _ in range(rng.randint(2, 12))],
            keys[i],
            max_new_tokens=None if budgets is None else budgets[i],
        )
        for i in range(n)
    ]


def _engine(model, slots: int, eos_id: int = 2, params: SamplingParams = PARAMS) -> RolloutEngine:
    return RolloutEngine(model, params, eos_id=eos_id, pad_id=0, slots=slots, max_len=64)


def _tokens(completions) -> dict[int, list[int]]:
    return {c.sample_id: c.tokens for c in completions}


def test_streaming_follows_completion_and_yields_every_sample_once(model):
    budgets = list(range(1, 25)) * 2  # lengths 1..max, eos disabled so each sample takes exactly its budget
    reqs = _requests(len(budgets), budgets=budgets)
    engine = _engine(model, slots=len(reqs), eos_id=-1)
    out = list(engine.stream(reqs))
    assert sorted(c.sample_id for c in out) == list(range(len(reqs)))
    lengths = [len(c.tokens) for c in out]
    assert lengths == sorted(lengths), "with every sample started together, shorter ones must come out first"
    assert all(len(c.tokens) == budgets[c.sample_id] and c.finish_reason == "length" for c in out)
    assert len(engine.step_log) == max(budgets)


def test_new_request_enters_as_soon_as_a_slot_frees(model):
    budgets = [2, 20, 20, 3]
    engine = _engine(model, slots=2, eos_id=-1)
    engine.submit(_requests(4, budgets=budgets))
    finished_at = {}
    step = 0
    while engine.has_work():
        step += 1
        for c in engine.step():
            finished_at[c.sample_id] = step
    # Step 1 prefills samples 0 and 1 (their first tokens). Sample 0 ends at step 2 and sample 2 is prefilled
    # into its slot in that same step, so it ends 19 steps later (21) instead of waiting for sample 1 (20).
    assert finished_at == {0: 2, 1: 20, 2: 21, 3: 22}
    assert max(decoded for decoded, _, _ in engine.step_log) <= 2


def test_tokens_do_not_depend_on_batch_slot_or_order(model):
    reqs = _requests(64, seed=5)
    batched = _tokens(_engine(model, slots=64).generate(reqs))
    alone = {r.sample_id: _engine(model, slots=1).generate([r])[0].tokens for r in reqs[::9]}
    reordered = _tokens(_engine(model, slots=7).generate(list(reversed(reqs))))
    assert len({len(t) for t in batched.values()}) > 3, "lengths should vary for the test to mean something"
    for sid, toks in alone.items():
        assert batched[sid] == toks
    assert reordered == batched


def test_a_shared_prompt_is_prefilled_once_and_samples_as_if_alone(model, monkeypatch):
    base = _requests(3, seed=7)
    keys = stream_keys(7, 1, range(12)).tolist()
    reqs = [Request(4 * i + j, list(base[i].prompt), keys[4 * i + j]) for i in range(3) for j in range(4)]
    engine = _engine(model, slots=12)
    prefilled = []
    forward = engine._forward
    monkeypatch.setattr(
        engine, "_forward", lambda ids, pos, kv, last: prefilled.append(ids.shape[0]) or forward(ids, pos, kv, last)
    )
    together = engine.generate(reqs)
    assert prefilled[0] == 3, "each of the 3 prompts prefilled once for its 4 samples"
    for r, got in zip(reqs, together):
        alone = _engine(model, slots=1).generate([r])[0]
        assert got.tokens == alone.tokens
        assert got.logps == pytest.approx(alone.logps, abs=1e-5)
    assert len({tuple(c.tokens) for c in together[:4]}) > 1, "a group's samples differ (own random streams)"


def test_abort_halfway_and_resubmit_gives_the_uninterrupted_sample(model):
    reqs = _requests(16, seed=7)
    full = _tokens(_engine(model, slots=16).generate(reqs))
    engine = _engine(model, slots=5)
    engine.submit(reqs)
    early = []
    for _ in range(4):
        early += engine.step()
    aborted = engine.abort([r.sample_id for r in reqs])
    assert {c.finish_reason for c in aborted} == {"aborted"}
    assert any(c.tokens for c in aborted) and any(not c.tokens for c in aborted), "live and waiting both aborted"
    by_id = {r.sample_id: r for r in reqs}
    resubmitted = [
        Request(c.sample_id, by_id[c.sample_id].prompt, by_id[c.sample_id].key, prefix=c.tokens, prefix_logps=c.logps)
        for c in aborted
    ]
    resumed = _engine(model, slots=3).generate(resubmitted)  # elsewhere, other slots, other batch
    assert {**_tokens(early), **_tokens(resumed)} == full


def test_logprobs_match_a_full_forward_pass(model):
    reqs = _requests(12, seed=9)
    for c, r in zip(_engine(model, slots=4, params=SamplingParams(24, 0.8)).generate(reqs), reqs):
        seq = torch.tensor([r.prompt + c.tokens])
        with torch.no_grad():
            logits = model(seq).logits[0, len(r.prompt) - 1 : -1] / 0.8
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.tokens)[:, None]).squeeze(-1)
        assert torch.allclose(ref, torch.tensor(c.logps), atol=1e-5)


def test_load_weights_changes_generation_and_backend_protocol(model):
    import copy

    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    reqs = _requests(8, seed=11)
    engine = _engine(copy.deepcopy(model), slots=8)
    before = _tokens(engine.generate(reqs))
    engine.load_weights(other.named_parameters())
    after = _tokens(engine.generate(reqs))
    assert after == _tokens(_engine(other, slots=8).generate(reqs)) and after != before
    assert isinstance(engine, GenerationBackend)


def test_budget_over_max_len_is_refused(model):
    engine = RolloutEngine(model, PARAMS, eos_id=2, pad_id=0, slots=2, max_len=16)
    with pytest.raises(ValueError, match="max_len 16"):
        engine.submit([Request(0, [1] * 10, 5, max_new_tokens=10)])


def test_length_stats():
    stats = length_stats([1, 2, 3, 4, 100])
    assert (stats.count, stats.max, stats.p50, stats.p90) == (5, 100, 3.0, 100.0)
    assert stats.mean == pytest.approx(22.0)
    assert length_stats([]).count == 0


def test_stop_tokens_end_a_sample_like_eos(model):
    reqs = _requests(16, seed=13)
    free = _tokens(_engine(model, slots=16, eos_id=-1).generate(reqs))
    stop = next(t for toks in free.values() for t in toks[1:])  # a token some sample emits after its first
    params = SamplingParams(24, 1.0, top_p=0.95, stop_ids=(stop,))
    stopped = _engine(model, slots=16, eos_id=-1, params=params).generate(reqs)
    for c in stopped:
        full = free[c.sample_id]
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert c.tokens == full[:cut]
        assert c.finish_reason == ("stop" if stop in full else "length")


def _episodes(engine_for_turn, reqs, turns: int, turn_tokens: int, seed: int):
    """Run every request as an episode of ``turns`` turns: after each turn, observation tokens (random, per
    episode and turn) are appended and the episode resubmitted with its whole history as prefix.
    ``engine_for_turn(turn)`` gives the engine of each turn. Returns the final completions by sample id."""
    rng = random.Random(seed)
    observations = {
        (r.sample_id, t): [rng.randint(4, 47) for _ in range(rng.randint(1, 4))] for r in reqs for t in range(turns)
    }
    current = {r.sample_id: r for r in reqs}
    done = {}
    for turn in range(turns):
        engine = engine_for_turn(turn)
        for c in engine.generate(list(current.values())):
            req = current[c.sample_id]
            if turn == turns - 1 or c.finish_reason == "eos":
                done[c.sample_id] = c
                engine.release([c.sample_id])
                del current[c.sample_id]
                continue
            obs = observations[(c.sample_id, turn)]
            budget = len(c.tokens) + len(obs) + turn_tokens
            current[c.sample_id] = Request(
                c.sample_id, req.prompt, req.key, budget, c.tokens + obs, c.logps + [0.0] * len(obs), keep_cache=True
            )
    return done


def test_a_continued_episode_samples_what_re_prefilling_each_turn_would(model):
    params = SamplingParams(max_new_tokens=5, temperature=1.0)
    reqs = [Request(r.sample_id, r.prompt, r.key, 5, keep_cache=True) for r in _requests(8, seed=11)]
    reused = _engine(model, slots=3, params=params)  # one engine: continuations reuse their kept caches
    kept = _episodes(lambda turn: reused, reqs, turns=3, turn_tokens=5, seed=1)
    fresh = _episodes(lambda turn: _engine(model, slots=3, params=params), reqs, turns=3, turn_tokens=5, seed=1)
    assert _tokens(kept.values()) == _tokens(fresh.values())
    assert any(len(c.tokens) > 10 for c in kept.values()), "some episodes went on for several turns"
    for sid, c in kept.items():
        assert torch.allclose(torch.tensor(c.logps), torch.tensor(fresh[sid].logps), atol=1e-5)
    assert reused.kept == {}, "ended episodes released their caches"
    # only the new tokens were prefilled: the last sampled token and the observation, not the history
    prefilled = sum(tokens for _, _, tokens in reused.step_log)
    history = sum(len(r.prompt) + len(c.tokens) for r, c in zip(reqs, (kept[r.sample_id] for r in reqs)))
    assert prefilled < history


def test_a_kept_cache_that_the_resubmission_does_not_extend_is_dropped(model):
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    req = Request(0, [1, 7, 8, 9], 123, 4, keep_cache=True)
    engine = _engine(model, slots=2, params=params)
    first = engine.generate([req])[0]
    assert set(engine.kept) == {0}
    other = Request(0, [1, 7, 8, 10], 123, 8, [5, 6], [0.0, 0.0])  # another context under the same id
    again = engine.generate([other])[0]
    alone = _engine(model, slots=2, params=params).generate([other])[0]
    assert again.tokens == alone.tokens and engine.kept == {} and first.tokens


def test_a_paused_sample_continued_elsewhere_is_the_uninterrupted_sample(model):
    """``pause_at``: a sample stops unfinished at a set length (a partial rollout's weight update) and frees its
    slot; resubmitted with its tokens as the prefix it goes on as if never paused, tokens and log-probs alike."""
    reqs = _requests(12, seed=5)
    full = {c.sample_id: c for c in _engine(model, slots=12).generate(reqs)}
    for r in reqs:
        r.pause_at = 3
    first = _engine(model, slots=4).generate(reqs)
    paused = [c for c in first if c.finish_reason == "paused"]
    assert paused and all(len(c.tokens) == 3 for c in paused)
    assert all(c.tokens == full[c.sample_id].tokens for c in first if c.finish_reason != "paused")
    by_id = {r.sample_id: r for r in reqs}
    again = [
        Request(c.sample_id, by_id[c.sample_id].prompt, by_id[c.sample_id].key, prefix=c.tokens, prefix_logps=c.logps)
        for c in paused
    ]
    engine = _engine(model, slots=3)
    for c in engine.generate(again):
        assert c.finish_reason != "paused" and c.tokens == full[c.sample_id].tokens
        assert c.logps == pytest.approx(full[c.sample_id].logps, abs=1e-5)
    assert len(engine.finished_lengths) == len(paused)


def test_a_decode_step_reads_the_device_once(model, monkeypatch):
    """On an accelerator every read of a device value makes the host wait for the device: a decode step reads
    back its sampled tokens and their log-probs only, in one transfer (the finished-sample check); the slots, the
    positions and the key length come from the host's own bookkeeping."""
    engine = _engine(model, slots=8, eos_id=-1)
    engine.submit(_requests(6, budgets=[20] * 6))
    engine.step()  # admits (prefills) every request
    reads: list[str] = []

    def counted(name: str, original):
        def read(self, *args, **kwargs):
            reads.append(name)
            return original(self, *args, **kwargs)

        return read

    for name in ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "equal", counted("equal", torch.equal))
    for _ in range(3):
        assert engine.step() == [] and not engine.waiting
    assert reads == ["tolist"] * 3
