"""The episode server's bounds, in process: an engine error during one turn ends only that episode; a storm of
abandoned episodes leaves the open, ended and forgotten episodes and the kept caches within their limits; a
request the engine could not hold is refused before it reaches the engine's thread."""

import threading

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from loomrl.models.tokenizer import build_char_tokenizer, decode_response
from loomrl.models.zoo import build_causal_lm
from loomrl.rollout import RolloutEngine, SamplingParams
from loomrl.rollout.serving import EndpointError, EngineFailure, EpisodeServer, ServingLimits

TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def _tokenizer():
    tok = PreTrainedTokenizerFast(tokenizer_object=build_char_tokenizer().backend_tokenizer)
    tok.pad_token, tok.eos_token, tok.bos_token = "<pad>", "</s>", "<s>"
    tok.chat_template = TEMPLATE
    return tok


class Poisoned(RolloutEngine):
    """An engine whose forward raises while one sample is live: a fault that belongs to one episode."""

    poison = 1

    def _forward(self, ids_BQ, pos_BQ, kv_len, last_B):
        if any(lv.request.sample_id == self.poison for lv in self.live):
            raise RuntimeError("a poisoned sample")
        return super()._forward(ids_BQ, pos_BQ, kv_len, last_B)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _server(limits: ServingLimits, engine_type=RolloutEngine, max_len: int = 128, clock=None) -> EpisodeServer:
    tok = _tokenizer()
    torch.manual_seed(0)
    model = build_causal_lm("llama-1m", build_char_tokenizer(), seed=3).eval()
    bar = tok.convert_tokens_to_ids("|")
    engine = engine_type(model, SamplingParams(8, 1.0, stop_ids=(bar,)), tok.eos_token_id, 0, slots=4, max_len=max_len)
    kwargs = {"clock": clock} if clock else {}
    return EpisodeServer(engine, tok, lambda ids: decode_response(tok, ids), 60, limits=limits, **kwargs)


class Running:
    """The server's engine loop on a thread, for a ``with`` block."""

    def __init__(self, server: EpisodeServer):
        self.server, self.stop = server, threading.Event()
        self.thread = threading.Thread(target=server.run, args=(self.stop.is_set,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self.server

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


ASK = [{"role": "user", "content": "12"}]


def test_an_engine_error_ends_only_its_episode_and_the_others_decode_in_the_same_steps():
    server = _server(ServingLimits(), Poisoned)
    good, bad, later = server.open(), server.open(), server.open()
    # both turns are queued before the engine's loop starts: they are admitted in one step, which raises
    turns = [server.begin(good, ASK), server.begin(bad, [{"role": "user", "content": "12"}])]
    with Running(server):
        reply = server.conclude(turns[0], turns[0].future.result(timeout=60))
        with pytest.raises(EngineFailure, match="RuntimeError: a poisoned sample"):
            turns[1].future.result(timeout=60)
        refusal = server.failed(turns[1], turns[1].future.exception(), 60)
        assert refusal.status == 500 and "ended: the engine failed on it: RuntimeError: a poisoned sample" in str(
            refusal
        )
        with pytest.raises(EndpointError, match="has ended \\(the engine failed on it"):
            server.chat(bad, ASK)
        assert server.chat(later, ASK)["completion_tokens"] >= 1
        messages = [*ASK, {"role": "assistant", "content": reply["content"]}, {"role": "user", "content": "3"}]
        assert server.chat(good, messages)["completion_tokens"] >= 1
    assert server.counts["engine_errors"] == 1
    assert server.trajectory(bad)["error"] and server.trajectory(bad)["reward"] is None
    # the good episode's tokens are those of a run without the poisoned neighbour
    alone = _server(ServingLimits(), Poisoned)
    with Running(alone):
        episode = alone.open()
        first = alone.chat(episode, ASK)
        alone.chat(
            episode, [*ASK, {"role": "assistant", "content": first["content"]}, {"role": "user", "content": "3"}]
        )
    assert alone.trajectory(episode)["response_ids"] == server.trajectory(good)["response_ids"]


def test_a_request_the_engine_cannot_hold_is_refused_before_the_engine():
    server = _server(ServingLimits(), max_len=64)
    episode = server.open()
    with pytest.raises(EndpointError, match="context of 2\\d\\d tokens leaves no room .* within the engine's 64"):
        server.begin(episode, [{"role": "user", "content": "7" * 200}])
    assert not server.engine.step_log and server.trajectory(episode)["turns"] == 0, "the engine never saw it"
    with Running(server):
        reply = server.chat(episode, [{"role": "user", "content": "7" * 50}])  # fits: its turn is cut to the room
    assert reply["prompt_tokens"] + reply["completion_tokens"] <= 64


def test_a_storm_of_abandoned_episodes_stays_within_the_limits():
    clock = Clock()
    limits = ServingLimits(max_episodes=16, ended=8, idle_timeout_s=10, kept_tokens=60)
    server = _server(limits, clock=clock)
    with Running(server):
        for i in range(600):
            clock.now += 1.0
            episode = server.open()
            if i % 4 == 0:  # some take a turn (their caches are kept) before their agent goes away
                server.chat(episode, ASK, max_tokens=3)
            if i % 50 == 0:  # and a few end
                server.finish(episode, 1.0)
            assert len(server.episodes) <= 16 and len(server.ended) <= 8
        kept = sum(len(k.context) for k in server.engine.kept.values())
    assert kept <= 60, "the kept caches stay within their token budget"
    assert len(server.gone) <= 16 * limits.max_episodes
    assert server.counts["expired"] >= 570
    with pytest.raises(EndpointError, match="expired after 10 s") as err:
        server.trajectory(next(k for k, why in server.gone.items() if "expired" in why))
    assert err.value.status == 410


def test_open_episodes_past_the_limit_are_refused_until_one_ends_or_expires():
    clock = Clock()
    server = _server(ServingLimits(max_episodes=3, ended=1, idle_timeout_s=5), clock=clock)
    first = [server.open() for _ in range(3)]
    with pytest.raises(EndpointError, match="3 episodes are open, the limit \\(--max-episodes 3\\)") as err:
        server.open()
    assert err.value.status == 429 and server.counts["refused"] == 1
    server.finish(first[0], 0.5)
    second = server.open()
    server.finish(first[1], 0.0)  # the oldest ended one is forgotten
    with pytest.raises(EndpointError, match="ended, and its trajectory was dropped") as err:
        server.trajectory(first[0])
    assert err.value.status == 410
    clock.now += 6
    assert server.open() and second not in server.episodes and first[2] not in server.episodes


def test_turns_in_flight_over_http_hold_no_thread_and_decode_in_the_same_steps():
    """48 agents' turns, more than the HTTP worker threads (40), are all in flight at once: queued while the engine's
    loop is not yet running, then admitted in one step and decoded together."""
    import json
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    import uvicorn

    from loomrl.rollout.openai_api import create_app

    tok = _tokenizer()
    model = build_causal_lm("llama-1m", build_char_tokenizer(), seed=3).eval()
    bar = tok.convert_tokens_to_ids("|")
    params = SamplingParams(6, 1.0, ignore_eos=True, stop_ids=(bar,))
    engine = RolloutEngine(model, params, tok.eos_token_id, 0, slots=48, max_len=64)
    server = EpisodeServer(engine, tok, lambda ids: decode_response(tok, ids), 6)
    http = uvicorn.Server(uvicorn.Config(create_app(server, "m"), host="127.0.0.1", port=0, log_level="critical"))
    web = threading.Thread(target=http.run, daemon=True)
    web.start()
    while not http.started:
        threading.Event().wait(0.01)
    base = f"http://127.0.0.1:{http.servers[0].sockets[0].getsockname()[1]}/v1"

    def turn(i: int) -> dict:
        episode = server.open()
        body = json.dumps({"messages": [{"role": "user", "content": str(i)}]}).encode()
        request = urllib.request.Request(f"{base}/episodes/{episode}/chat/completions", data=body, method="POST")
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())

    try:
        with ThreadPoolExecutor(48) as pool:
            replies = [pool.submit(turn, i) for i in range(48)]
            while server._inbox.qsize() < 48:  # every turn queued, none answered: the engine is not running yet
                assert not any(r.done() for r in replies), [r.result() for r in replies if r.done()][:1]
                threading.Event().wait(0.01)
            with Running(server):
                answers = [r.result(timeout=60) for r in replies]
    finally:
        http.should_exit = True
        web.join(timeout=10)
    assert all(1 <= a["usage"]["completion_tokens"] <= 6 for a in answers)
    assert engine.step_log[0] == (0, 48, sum(a["usage"]["prompt_tokens"] for a in answers))
    assert engine.step_log[1][0] == sum(a["usage"]["completion_tokens"] > 1 for a in answers)
