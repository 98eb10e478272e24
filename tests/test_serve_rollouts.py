"""The OpenAI-compatible rollout endpoint, driven by the real ``openai`` client: agent loops of several turns whose
trajectories keep the exact tokens and log-probs, and bad requests that get an HTTP error, never a dead server."""

import json
import threading
import urllib.error
import urllib.request

import openai
import pytest
import torch
import uvicorn
from transformers import PreTrainedTokenizerFast

from loomrl.models.tokenizer import build_char_tokenizer, decode_response, encode_prompt
from loomrl.models.zoo import build_causal_lm
from loomrl.rollout import RolloutEngine, SamplingParams
from loomrl.rollout.episodes import ObservationTokens
from loomrl.rollout.openai_api import create_app
from loomrl.rollout.serving import EpisodeServer

TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


@pytest.fixture(scope="module")
def served():
    """A llama-1m behind the endpoint on a free port: (base url, the server, the model, the tokenizer)."""
    tok = PreTrainedTokenizerFast(tokenizer_object=build_char_tokenizer().backend_tokenizer)
    tok.pad_token, tok.eos_token, tok.bos_token = "<pad>", "</s>", "<s>"
    tok.chat_template = TEMPLATE
    torch.manual_seed(0)
    model = build_causal_lm("llama-1m", build_char_tokenizer(), seed=3).eval()
    bar = tok.convert_tokens_to_ids("|")
    engine = RolloutEngine(model, SamplingParams(12, 1.0, stop_ids=(bar,)), tok.eos_token_id, 0, slots=8, max_len=256)
    server = EpisodeServer(engine, tok, lambda ids: decode_response(tok, ids), max_tokens=120, seed=5)
    stop = threading.Event()
    loop = threading.Thread(target=server.run, args=(stop.is_set,), daemon=True)
    loop.start()
    http = uvicorn.Server(uvicorn.Config(create_app(server, "llama-1m"), host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    while not http.started:
        threading.Event().wait(0.01)
    port = http.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}/v1", server, model, tok
    http.should_exit = True
    stop.set()
    thread.join(timeout=10)
    loop.join(timeout=10)


def _http(method: str, url: str, body=None, raw: bytes | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a plain HTTP request (what a script without the openai client sends)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _episode(base: str) -> str:
    return _http("POST", f"{base}/episodes")[1]["episode_id"]


def _agent(base: str, question: str, turns: int = 3) -> tuple[str, list[dict], list[str]]:
    """An agent as users write them: the openai client, the conversation resent each turn, tool replies appended."""
    episode = _episode(base)
    client = openai.OpenAI(base_url=f"{base}/episodes/{episode}", api_key="unused")
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": question}]
    replies = []
    for turn in range(turns):
        reply = client.chat.completions.create(model="llama-1m", messages=messages, max_tokens=6)
        text = reply.choices[0].message.content
        assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1
        replies.append(text)
        messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": f"r{turn}"}]
    status, body = _http("POST", f"{base}/episodes/{episode}/reward", {"reward": 0.5})
    assert status == 200 and body["ended"]
    return episode, messages, replies


def test_agents_run_unmodified_and_their_trajectories_keep_the_exact_tokens(served):
    base, server, model, tok = served
    results: dict[str, tuple] = {}
    agents = [threading.Thread(target=lambda q=q: results.__setitem__(q, _agent(base, q))) for q in ("12", "34", "5")]
    for t in agents:
        t.start()
    for t in agents:
        t.join(timeout=120)
    assert len(results) == 3, "every agent finished"
    observe = ObservationTokens(tok, [tok.eos_token_id, tok.convert_tokens_to_ids("|")])
    for episode, messages, replies in results.values():
        traj = _http("GET", f"{base}/episodes/{episode}")[1]
        assert traj["ended"] and traj["reward"] == 0.5 and traj["turns"] == 3
        assert traj["prompt_ids"] == encode_prompt(tok, messages[:2])
        tokens, mask, logps = traj["response_ids"], traj["mask"], traj["logprobs"]
        assert len(tokens) == len(mask) == len(logps)
        # the turns' sampled tokens, split at the observations, decode to the replies the agent got
        turns, current = [], []
        for t, m in zip(tokens, mask):
            if m:
                current.append(t)
            elif current:
                turns.append(current)
                current = []
        turns.append(current)
        assert [decode_response(tok, t) for t in turns] == replies
        # observations are the tool messages as the chat template renders them after a turn's end
        observed = [t for t, m in zip(tokens, mask) if m == 0]
        assert observed == observe([messages[3]]) + observe([messages[5]])
        # the log-probs are the model's for the whole sequence, sampled tokens only
        seq = torch.tensor([traj["prompt_ids"] + tokens])
        with torch.no_grad():
            logits = model(seq).logits[0, len(traj["prompt_ids"]) - 1 : -1]
        ref = torch.log_softmax(logits, -1).gather(-1, seq[0, len(traj["prompt_ids"]) :, None]).squeeze(-1)
        sampled = torch.tensor(mask) == 1
        assert torch.allclose(ref[sampled], torch.tensor(logps)[sampled], atol=1e-4)
        assert all(lp == 0 for lp, m in zip(logps, mask) if not m)
    assert server.engine.kept == {}, "ended episodes hold no cache"


def test_bad_requests_get_one_line_http_errors_and_the_server_goes_on(served):
    base, server, _, _ = served
    client = openai.OpenAI(base_url=base, api_key="unused")
    ask = [{"role": "user", "content": "7"}]
    with pytest.raises(openai.NotFoundError, match="no episode 'nope'"):
        client.chat.completions.create(model="m", messages=ask, extra_body={"episode_id": "nope"})
    with pytest.raises(openai.BadRequestError, match="name the episode"):
        client.chat.completions.create(model="m", messages=ask)
    episode = _episode(base)
    in_episode = openai.OpenAI(base_url=f"{base}/episodes/{episode}", api_key="unused")
    for bad, message in [
        ([], "non-empty list"),
        ([{"role": "robot", "content": "x"}], "message 0 must have a role"),
        ([{"role": "user", "content": 3}], "message 0 must have a role"),
        (
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
            "the last message is the assistant",
        ),
    ]:
        with pytest.raises(openai.BadRequestError, match=message):
            in_episode.chat.completions.create(model="m", messages=bad)
    with pytest.raises(openai.BadRequestError, match="temperature 0.3 differs"):
        in_episode.chat.completions.create(model="m", messages=ask, temperature=0.3)
    first = in_episode.chat.completions.create(model="m", messages=ask, max_tokens=4).choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="message 1 differs"):
        in_episode.chat.completions.create(
            model="m", messages=[*ask, {"role": "assistant", "content": first + "x"}, {"role": "user", "content": "1"}]
        )
    with pytest.raises(openai.BadRequestError, match="it has 2 messages and no new one"):
        in_episode.chat.completions.create(model="m", messages=[*ask, {"role": "assistant", "content": first}, *[]][:1])
    status, body = _http("POST", f"{base}/episodes/{episode}/reward", {"reward": "high"})
    assert status == 400 and "reward must be a finite number" in body["error"]["message"]
    assert _http("POST", f"{base}/episodes/{episode}/reward", {"reward": 1})[0] == 200
    with pytest.raises(openai.ConflictError, match="has ended"):
        in_episode.chat.completions.create(model="m", messages=ask)
    status, body = _http("POST", f"{base}/episodes/x/chat/completions", raw=b"{not json")
    assert status == 400 and "\n" not in body["error"]["message"]
    assert _http("POST", f"{base}/episodes", {"episode_id": episode})[0] == 409
    # and it still serves
    assert _agent(base, "9", turns=1)[2]
    assert _http("GET", f"{base}/models")[1]["data"][0]["id"] == "llama-1m"


def test_the_command_serves_until_interrupted_and_writes_each_ended_episode(tmp_path):
    import signal
    import subprocess
    import sys

    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    out = tmp_path / "trajectories.jsonl"
    cmd = [sys.executable, "-m", "loomrl.cli", "serve-rollouts", "llama-1m", "--port", "0", "--max-tokens", "40"]
    proc = subprocess.Popen(
        [*cmd, "--chat-template", str(template), "--stop-token", "|", "--trajectories", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving llama-1m on http://127.0.0.1:"), line + proc.stderr.read()
        base = line.split(" on ")[1].split()[0]
        episode, messages, replies = _agent(base, "42", turns=2)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
    written = [json.loads(x) for x in out.read_text().splitlines()]
    assert [t["episode_id"] for t in written] == [episode] and written[0]["turns"] == 2
    assert written[0]["reward"] == 0.5 and sum(written[0]["mask"]) >= 2
    bad = subprocess.run([*cmd[:4], "nope-model"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "nope-model" in bad.stderr
    none = subprocess.run([*cmd], capture_output=True, text=True, timeout=60)
    assert none.returncode == 2 and "no chat template" in none.stderr and none.stderr.count("\n") == 1
    limit = subprocess.run([*cmd, "--max-episodes", "0"], capture_output=True, text=True, timeout=60)
    assert limit.returncode == 2 and limit.stderr.count("\n") == 1
    assert "--max-episodes 0: must be at least 1" in limit.stderr


class _Agent:
    """Two turns through the openai client; then returns ``reward`` (or raises it, if it is an exception)."""

    def __init__(self, reward):
        self.reward = reward

    def run(self, base_url, messages):
        client = openai.OpenAI(base_url=base_url, api_key="unused")
        for _ in range(2):
            text = client.chat.completions.create(model="p", messages=messages).choices[0].message.content
            messages = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": " ok:"}]
        if isinstance(self.reward, Exception):
            raise self.reward
        return self.reward


def test_run_agents_fills_episodes_and_a_failing_agent_ends_only_its_own_episode():
    from loomrl.rollout import stream_keys
    from loomrl.rollout.agents import run_agents
    from loomrl.rollout.episodes import Episode, EpisodeSettings, conversation_ids

    tok = build_char_tokenizer()
    model = build_causal_lm("llama-1m", tok, seed=3).eval()
    opening = [{"role": "user", "content": "12:"}]
    prompt = conversation_ids(tok, opening)

    def run(rewards):
        keys = stream_keys(0, 0, range(len(rewards))).tolist()
        episodes = [Episode(i, prompt, keys[i], 20, _Agent(r), opening=opening) for i, r in enumerate(rewards)]
        engine = RolloutEngine(model, SamplingParams(20), tok.eos_token_id, 0, slots=4, max_len=64)
        settings = EpisodeSettings(max_turns=3, turn_tokens=4, step_timeout_s=30)
        return run_agents(engine, episodes, tok, lambda ids: decode_response(tok, ids), settings, "agent 'x'")

    done = run([1.0, 0.5, 0.0])
    assert [ep.reward for ep in done] == [1.0, 0.5, 0.0] and all(ep.turns == 2 for ep in done)
    assert all(len(ep.tokens) == len(ep.mask) == len(ep.logps) and 0 in ep.mask for ep in done)
    assert {ep.finish for ep in done} == {"done"}
    # an agent that raises, returns no reward or a reward that is no number ends its episode with 0; the rest go on
    done = run([1.0, ValueError("no tool"), None, "high", 0.5])
    assert [ep.reward for ep in done] == [1.0, 0.0, 0.0, 0.0, 0.5]
    assert [ep.finish for ep in done] == ["done", "agent_error", "agent_error", "agent_error", "done"]
    assert all(ep.turns == 2 and len(ep.tokens) == len(ep.mask) == len(ep.logps) for ep in done)


def test_a_turn_that_times_out_is_dropped_and_the_episode_goes_on():
    from loomrl.rollout.serving import EndpointError

    tok = PreTrainedTokenizerFast(tokenizer_object=build_char_tokenizer().backend_tokenizer)
    tok.pad_token, tok.eos_token, tok.bos_token = "<pad>", "</s>", "<s>"
    tok.chat_template = TEMPLATE
    model = build_causal_lm("llama-1m", build_char_tokenizer(), seed=3).eval()
    bar = tok.convert_tokens_to_ids("|")
    engine = RolloutEngine(model, SamplingParams(8, 1.0, stop_ids=(bar,)), tok.eos_token_id, 0, slots=2, max_len=128)
    server = EpisodeServer(engine, tok, lambda ids: decode_response(tok, ids), max_tokens=40)
    episode = server.open()
    ask = [{"role": "user", "content": "3"}]
    with pytest.raises(EndpointError, match="no reply within 0.05 s") as err:
        server.chat(episode, ask, timeout_s=0.05)  # the engine's loop is not running yet
    assert err.value.status == 504 and server.trajectory(episode)["turns"] == 0
    stop = threading.Event()
    loop = threading.Thread(target=server.run, args=(stop.is_set,), daemon=True)
    loop.start()
    try:
        reply = server.chat(episode, ask, timeout_s=60)
    finally:
        stop.set()
        loop.join(timeout=10)
    assert reply["completion_tokens"] >= 1 and server.trajectory(episode)["turns"] == 1
