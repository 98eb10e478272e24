"""Multi-turn episodes in the rollout engine: observations appended, masks, budgets, slow and failing
environments, and tokens that do not depend on kept caches, slots or which environment answered first."""

import random
import time
from dataclasses import dataclass, field

import pytest
import torch

from loomrl.errors import DataError
from loomrl.models.tokenizer import build_char_tokenizer
from loomrl.models.zoo import build_causal_lm
from loomrl.rollout import RolloutEngine, SamplingParams, stream_keys
from loomrl.rollout.episodes import Episode, EpisodeSettings, ObservationTokens, run_episodes

TOKENIZER = build_char_tokenizer()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_causal_lm("llama-1m", TOKENIZER, seed=3).eval()


@dataclass
class StepResult:
    messages: list
    reward: float = 0.0
    done: bool = False
    metrics: dict = field(default_factory=dict)


class Counter:
    """Replies 'ok <n>' to every turn; done after ``turns`` turns with reward 1; sleeps ``delay`` (random
    by default) first, so environments answer in any order."""

    def __init__(self, turns: int = 3, delay: float | None = None, seed: int = 0, fail: bool = False):
        self.turns, self.seen, self.fail = turns, 0, fail
        self.delay = random.Random(seed).uniform(0, 0.02) if delay is None else delay

    def step(self, text: str) -> StepResult:
        time.sleep(self.delay)
        if self.fail:
            raise ValueError("broken environment")
        self.seen += 1
        if self.seen >= self.turns:
            return StepResult([], 1.0, True, {"steps": 1.0})
        return StepResult([{"role": "user", "content": f"ok {self.seen}"}], 0.25, False, {"steps": 1.0})


def _episodes(n: int, budget: int = 40, **env) -> list[Episode]:
    rng = random.Random(5)
    keys = stream_keys(0, 0, range(n)).tolist()
    return [
        Episode(
            i, [1] + [rng.randint(4, 40) for _ in range(rng.randint(2, 6))], keys[i], budget, Counter(seed=i, **env)
        )
        for i in range(n)
    ]


SETTINGS = EpisodeSettings(max_turns=5, turn_tokens=6)


def _run(model, episodes, slots=4, settings=SETTINGS):
    engine = RolloutEngine(model, SamplingParams(max_new_tokens=8), eos_id=2, pad_id=0, slots=slots, max_len=64)
    observe = ObservationTokens(TOKENIZER, [2])
    return run_episodes(engine, episodes, observe, TOKENIZER.decode, settings), engine


def test_episodes_interleave_sampled_and_observed_tokens(model):
    done, engine = _run(model, _episodes(6))
    ok = TOKENIZER.encode("ok 1", add_special_tokens=False)
    for ep in done:
        assert len(ep.tokens) == len(ep.logps) == len(ep.mask) <= ep.budget
        assert ep.finish in ("done", "budget", "turns")
        observed = [t for t, m in zip(ep.tokens, ep.mask) if m == 0]
        if ep.turns > 1:
            assert observed[: len(ok)] == ok, "the first observation follows the first turn"
        assert all(lp == 0.0 for lp, m in zip(ep.logps, ep.mask) if m == 0)
        assert all(lp < 0.0 for lp, m in zip(ep.logps, ep.mask) if m == 1)
        if ep.finish == "done":
            assert ep.reward == pytest.approx(1.0 + 0.25 * (ep.turns - 1)) and ep.metrics["steps"] == ep.turns
    assert any(ep.finish == "done" and ep.turns == 3 for ep in done)
    assert engine.kept == {}, "ended episodes hold no cache"


def test_tokens_do_not_depend_on_kept_caches_slots_or_environment_timing(model):
    first, _ = _run(model, _episodes(8), slots=3)
    reprefill = EpisodeSettings(max_turns=5, turn_tokens=6, keep_cache=False)  # every turn prefills the history
    again, engine = _run(model, _episodes(8, delay=0.0), slots=8, settings=reprefill)
    assert engine.kept == {}
    assert [ep.tokens for ep in first] == [ep.tokens for ep in again]
    assert [ep.mask for ep in first] == [ep.mask for ep in again]
    for a, b in zip(first, again):
        assert torch.allclose(torch.tensor(a.logps), torch.tensor(b.logps), atol=1e-5)


def test_budget_turns_and_penalty(model):
    short = EpisodeSettings(max_turns=5, turn_tokens=6, at_budget="penalise", budget_penalty=0.5)
    done, _ = _run(model, _episodes(6, budget=9), settings=short)
    cut = [ep for ep in done if ep.finish == "budget"]
    assert cut and all(len(ep.tokens) <= 9 for ep in done)
    assert all(ep.reward == pytest.approx(0.25 * ep.metrics.get("steps", 0) - 0.5) for ep in cut)
    one, _ = _run(model, _episodes(4), settings=EpisodeSettings(max_turns=1, turn_tokens=6))
    assert all(ep.turns == 1 and ep.finish in ("turns", "budget", "done") for ep in one)
    assert all(0 not in ep.mask for ep in one), "no observation after the last turn"


def test_a_slow_environment_ends_its_episode_and_a_failing_one_stops_in_one_line(model):
    settings = EpisodeSettings(max_turns=3, turn_tokens=4, step_timeout_s=0.05)
    done, _ = _run(model, _episodes(3, delay=0.5), settings=settings)
    assert {ep.finish for ep in done} == {"timeout"} and all(ep.reward == 0 for ep in done)
    with pytest.raises(DataError, match=r"^environment: step raised ValueError: broken environment$"):
        _run(model, _episodes(2, fail=True))


def test_observations_follow_a_chat_templates_turn_end():
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=TOKENIZER.backend_tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}"
    tok.chat_template += "{% if add_generation_prompt %}a:{% endif %}"
    bar = tok.convert_tokens_to_ids("|")
    observe = ObservationTokens(tok, [bar])
    assert tok.decode(observe([{"role": "user", "content": "hi"}])) == "u:hi|a:"
    with pytest.raises(DataError, match="none of the tokens"):
        ObservationTokens(tok, [2])


def test_each_steps_reward_is_kept_on_the_last_token_of_the_turn_that_earned_it(model):
    done, _ = _run(model, _episodes(6))
    for ep in done:
        rewards = ep.token_rewards()
        assert len(rewards) == len(ep.tokens)
        turn_ends = [i for i, m in enumerate(ep.mask) if m == 1 and (i + 1 == len(ep.mask) or ep.mask[i + 1] == 0)]
        steps = int(ep.metrics.get("steps", 0))  # turns answered by the environment (a budget cut's was not)
        earned = [0.25] * (steps - 1) + [1.0 if ep.finish == "done" else 0.25] if steps else []
        assert [rewards[i] for i in turn_ends[:steps]] == earned
        assert sum(rewards) == pytest.approx(ep.reward) and sum(r != 0 for r in rewards) == steps
