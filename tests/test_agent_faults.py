"""Agents that misbehave during a training run: each ends its own episode with reward 0, counted in the run's
episode metrics, and the run goes on to its last iteration."""

import json
import textwrap

import pytest

from loomrl.train.rl import RLTrainer
from test_runtime import _cfg

AGENT = textwrap.dedent(
    """
    import math

    import openai


    class Unruly:
        # by the episode's sample id: a well-behaved agent, one that sends 2 MB, one that raises, one that reports NaN

        def reset(self, row):
            return [{"role": "user", "content": row["prompt"]}]

        def run(self, base_url, messages):
            self.kind = int(base_url.rstrip("/").rsplit("/", 1)[1]) % 4
            client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
            if self.kind == 1:
                messages = [{"role": "user", "content": "7" * 2_000_000}]
            reply = client.chat.completions.create(model="policy", messages=messages)
            if self.kind == 2:
                raise RuntimeError("the tool crashed")
            return math.nan if self.kind == 3 else float(len(reply.choices[0].message.content) > 2)
    """
)


@pytest.fixture
def agent_file(tmp_path):
    path = tmp_path / "unruly_agent.py"
    path.write_text(AGENT)
    return f"{path}:Unruly"


def test_misbehaving_agents_end_their_own_episodes_and_the_run_goes_on(tmp_path, agent_file):
    args = (
        f"rollout.env.name={agent_file}",
        "rollout.env.max_turns=2",
        "rollout.env.turn_tokens=5",
        "rollout.max_new_tokens=12",
        "algo.name=grpo",
        "algo.group_size=4",
        "rollout.prompts_per_iter=4",
        "loop.iterations=2",
    )
    RLTrainer(_cfg(tmp_path, "run", *args)).run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2, "both iterations ran"
    for row in rows:
        errors = row["episode/finish_agent_error"]
        assert errors == 0.75, row  # three kinds in four misbehave
        assert row["episode/finish_done"] > 0


class _Sleeper:
    """One turn, then it hangs well past the deadline."""

    def run(self, base_url, messages):
        import time

        import openai

        openai.OpenAI(base_url=base_url, api_key="unused").chat.completions.create(model="p", messages=messages)
        time.sleep(8)
        return 1.0


def test_an_agent_past_the_deadline_ends_its_own_episode_and_the_others_keep_theirs():
    from loomrl.models.tokenizer import build_char_tokenizer, decode_response
    from loomrl.models.zoo import build_causal_lm
    from loomrl.rollout import RolloutEngine, SamplingParams, stream_keys
    from loomrl.rollout.agents import run_agents
    from loomrl.rollout.episodes import Episode, EpisodeSettings, conversation_ids
    from test_serve_rollouts import _Agent

    tok = build_char_tokenizer()
    model = build_causal_lm("llama-1m", tok, seed=3).eval()
    opening = [{"role": "user", "content": "12:"}]
    prompt = conversation_ids(tok, opening)
    keys = stream_keys(0, 0, range(3)).tolist()
    agents = [_Agent(1.0), _Sleeper(), _Agent(0.5)]
    episodes = [Episode(i, prompt, keys[i], 20, a, opening=opening) for i, a in enumerate(agents)]
    engine = RolloutEngine(model, SamplingParams(20), tok.eos_token_id, 0, slots=4, max_len=64)
    settings = EpisodeSettings(max_turns=2, turn_tokens=4, step_timeout_s=1.0)
    done = run_agents(engine, episodes, tok, lambda ids: decode_response(tok, ids), settings, "agent 'x'")
    assert [ep.finish for ep in done] == ["done", "agent_timeout", "done"]
    assert [ep.reward for ep in done] == [1.0, 0.0, 0.5] and done[1].turns == 1
