"""The rollout endpoint under hostile requests: every kind of malformed, oversized, ill-typed, ill-encoded,
out-of-order or flooding request gets one answer (an error of one line in OpenAI's shape, or a reply), and a normal
episode still runs after all of them on the same server."""

import http.client
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
import uvicorn
from transformers import PreTrainedTokenizerFast

from loomrl.models.tokenizer import build_char_tokenizer, decode_response
from loomrl.models.zoo import build_causal_lm
from loomrl.rollout import RolloutEngine, SamplingParams
from loomrl.rollout.openai_api import create_app
from loomrl.rollout.serving import EpisodeServer, ServingLimits

TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
BODY_LIMIT = 16 * 1024
MAX_LEN = 256
IDLE_S = 60.0


class Endpoint:
    """A llama-1m behind the endpoint on a free port, with a clock the test moves (idle expiry)."""

    def __init__(self):
        tok = PreTrainedTokenizerFast(tokenizer_object=build_char_tokenizer().backend_tokenizer)
        tok.pad_token, tok.eos_token, tok.bos_token = "<pad>", "</s>", "<s>"
        tok.chat_template = TEMPLATE
        torch.manual_seed(0)
        model = build_causal_lm("llama-1m", build_char_tokenizer(), seed=3).eval()
        bar = tok.convert_tokens_to_ids("|")
        params = SamplingParams(8, 1.0, stop_ids=(bar,))
        engine = RolloutEngine(model, params, tok.eos_token_id, 0, slots=8, max_len=MAX_LEN)
        self.skew = 0.0
        limits = ServingLimits(max_body_bytes=BODY_LIMIT, max_messages=32, max_episodes=48, idle_timeout_s=IDLE_S)
        self.server = EpisodeServer(
            engine,
            tok,
            lambda ids: decode_response(tok, ids),
            max_tokens=120,
            seed=5,
            limits=limits,
            clock=lambda: __import__("time").monotonic() + self.skew,
        )
        self.server.warm()
        self.stop = threading.Event()
        self.loop = threading.Thread(target=self.server.run, args=(self.stop.is_set,), daemon=True)
        self.loop.start()
        config = uvicorn.Config(create_app(self.server, "llama-1m"), host="127.0.0.1", port=0, log_level="critical")
        self.http = uvicorn.Server(config)
        self.web = threading.Thread(target=self.http.run, daemon=True)
        self.web.start()
        while not self.http.started:
            threading.Event().wait(0.01)
        self.port = self.http.servers[0].sockets[0].getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}/v1"

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict | None = None, chunked: bool = False
    ) -> tuple[int, dict]:
        """(status, JSON answer) of one raw request over loopback."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers=headers or {}, encode_chunked=chunked)
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    def post(self, path: str, body) -> tuple[int, dict]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.request("POST", path, raw, {"content-type": "application/json"})

    def episode(self) -> str:
        status, body = self.post("/v1/episodes", {})
        assert status == 200, body
        return body["episode_id"]

    def turn(self, episode: str, body) -> tuple[int, dict]:
        return self.post(f"/v1/episodes/{episode}/chat/completions", body)

    def close(self):
        self.http.should_exit = True
        self.stop.set()
        self.web.join(timeout=10)
        self.loop.join(timeout=10)


@pytest.fixture(scope="module")
def endpoint():
    e = Endpoint()
    yield e
    e.close()


ASK = [{"role": "user", "content": "12"}]


def _chat(e: Endpoint, messages=None, **extra) -> tuple[int, dict]:
    return e.turn(e.episode(), {"model": "m", "messages": ASK if messages is None else messages, **extra})


def _raw(e: Endpoint, raw: bytes) -> tuple[int, dict]:
    return e.turn(e.episode(), raw)


def _reward(e: Endpoint, value) -> tuple[int, dict]:
    episode = e.episode()
    return e.post(f"/v1/episodes/{episode}/reward", value)


def _ended(e: Endpoint, what: str) -> tuple[int, dict]:
    episode = e.episode()
    assert e.post(f"/v1/episodes/{episode}/reward", {"reward": 1})[0] == 200
    if what == "reward":
        return e.post(f"/v1/episodes/{episode}/reward", {"reward": 1})
    return e.turn(episode, {"messages": ASK})


def _not_continuing(e: Endpoint, how: str) -> tuple[int, dict]:
    episode = e.episode()
    status, body = e.turn(episode, {"messages": ASK, "max_tokens": 3})
    assert status == 200
    reply = {"role": "assistant", "content": body["choices"][0]["message"]["content"]}
    later = {
        "edited": [*ASK, {**reply, "content": reply["content"] + "x"}, {"role": "user", "content": "1"}],
        "repeated": [*ASK, reply],
        "shorter": ASK,
        "reordered": [reply, *ASK, {"role": "user", "content": "1"}],
    }[how]
    return e.turn(episode, {"messages": later})


def _expired(e: Endpoint) -> tuple[int, dict]:
    episode = e.episode()
    e.skew += IDLE_S + 1  # every open episode is idle past the timeout now
    return e.turn(episode, {"messages": ASK})


def _flood_opens(e: Endpoint) -> tuple[int, dict]:
    """Open episodes until refused; the refusal is the answer checked, the flood's episodes are ended after."""
    opened, answer = [], (200, {})
    for _ in range(e.server.limits.max_episodes + 1):
        answer = e.post("/v1/episodes", {})
        if answer[0] != 200:
            break
        opened.append(answer[1]["episode_id"])
    for episode in opened:
        assert e.post(f"/v1/episodes/{episode}/reward", {"reward": 0})[0] == 200
    return answer


def _flood_turns(e: Endpoint) -> tuple[int, dict]:
    """40 first turns at once, from 40 episodes: every one is answered."""
    episodes = [e.episode() for _ in range(40)]
    with ThreadPoolExecutor(40) as pool:
        answers = list(pool.map(lambda ep: e.turn(ep, {"messages": ASK, "max_tokens": 4}), episodes))
    assert [s for s, _ in answers] == [200] * 40
    for episode in episodes:
        assert e.post(f"/v1/episodes/{episode}/reward", {"reward": 0})[0] == 200
    return answers[0]


def _gone_mid_turn(e: Endpoint) -> tuple[int, dict]:
    """A client that sends a turn and hangs up without reading: the turn still finishes and the episode goes on
    (its reward is taken, not refused as busy)."""
    episode = e.episode()
    conn = http.client.HTTPConnection("127.0.0.1", e.port, timeout=10)
    body = json.dumps({"messages": ASK}).encode()
    conn.request("POST", f"/v1/episodes/{episode}/chat/completions", body, {"content-type": "application/json"})
    conn.close()
    for _ in range(3000):
        if e.request("GET", f"/v1/episodes/{episode}")[1]["turns"] == 1:
            break
        threading.Event().wait(0.01)
    return e.post(f"/v1/episodes/{episode}/reward", {"reward": 1})


def _chunked_too_large(e: Endpoint) -> tuple[int, dict]:
    chunks = (b"x" * 4096 for _ in range(BODY_LIMIT // 4096 + 2))  # no length declared
    return e.request("POST", f"/v1/episodes/{e.episode()}/chat/completions", chunks, chunked=True)


def _content(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


KINDS: dict[str, tuple[int, str, Callable[[Endpoint], tuple[int, dict]]]] = {
    # ids and routes
    "unknown episode": (404, "no episode 'nope'", lambda e: e.turn("nope", {"messages": ASK})),
    "id of 10,000 characters": (404, "no episode", lambda e: e.turn("x" * 10_000, {"messages": ASK})),
    "id with escapes and unicode": (404, "no episode", lambda e: e.turn("..%00%E2%98%83", {"messages": ASK})),
    "no episode named": (400, "name the episode", lambda e: e.post("/v1/chat/completions", {"messages": ASK})),
    "episode named by a number": (
        400,
        "name the episode",
        lambda e: e.post("/v1/chat/completions", {"messages": ASK, "episode_id": 7}),
    ),
    "open with a numeric id": (400, "episode_id must be a string", lambda e: e.post("/v1/episodes", {"episode_id": 3})),
    "open with a long id": (400, "1 to 128 printable", lambda e: e.post("/v1/episodes", {"episode_id": "y" * 129})),
    "open with a control character": (400, "printable", lambda e: e.post("/v1/episodes", {"episode_id": "a\nb"})),
    "open an id twice": (409, "exists already", lambda e: e.post("/v1/episodes", {"episode_id": e.episode()})),
    "unknown route": (404, "Not Found", lambda e: e.post("/v1/completions", {"prompt": "x"})),
    "wrong method": (405, "Method Not Allowed", lambda e: e.request("GET", "/v1/chat/completions")),
    # bodies: sizes, encodings, shapes
    "malformed JSON": (400, "not JSON", lambda e: _raw(e, b"{not json")),
    "bytes that are not UTF-8": (400, "not JSON", lambda e: _raw(e, b'{"messages": "\xff\xfe"}')),
    "empty body": (400, "not JSON", lambda e: _raw(e, b"")),
    "a gzip-compressed body": (
        400,
        "not JSON",
        lambda e: _raw(e, __import__("gzip").compress(json.dumps({"messages": ASK}).encode())),
    ),
    "UTF-8 with a byte-order mark": (
        200,
        "",
        lambda e: _raw(e, b"\xef\xbb\xbf" + json.dumps({"messages": ASK}).encode()),
    ),
    "UTF-16 JSON": (200, "", lambda e: _raw(e, json.dumps({"messages": ASK}).encode("utf-16"))),
    "a JSON array": (400, "must be a JSON object, not list", lambda e: _raw(e, b"[1, 2]")),
    "JSON null": (400, "must be a JSON object, not NoneType", lambda e: _raw(e, b"null")),
    "JSON nested 8,000 deep": (400, "nested too deeply", lambda e: _raw(e, b"[" * 8_000 + b"]" * 8_000)),
    "declared body over the limit": (
        413,
        "--max-body-bytes",
        lambda e: _chat(e, _content("7" * (BODY_LIMIT + 10))),
    ),
    "2 MB message": (413, "--max-body-bytes", lambda e: _chat(e, _content("7" * 2_000_000))),
    "chunked body over the limit": (413, "--max-body-bytes", _chunked_too_large),
    # messages
    "messages a string": (400, "non-empty list", lambda e: _chat(e, "hello")),
    "messages an object": (400, "non-empty list", lambda e: _chat(e, {"role": "user", "content": "x"})),
    "messages empty": (400, "non-empty list", lambda e: _chat(e, [])),
    "messages missing": (400, "non-empty list", lambda e: e.turn(e.episode(), {"model": "m"})),
    "a message without a role": (400, "message 0 must have a role", lambda e: _chat(e, [{"content": "x"}])),
    "an unknown role": (400, "message 0 must have a role", lambda e: _chat(e, [{"role": "robot", "content": "x"}])),
    "a role that is a list": (400, "must have a role", lambda e: _chat(e, [{"role": ["user"], "content": "x"}])),
    "a message that is a string": (400, "message 1 must have a role", lambda e: _chat(e, [*ASK, "hi"])),
    "numeric content": (400, "must have a role", lambda e: _chat(e, [{"role": "user", "content": 3}])),
    "null content": (400, "must have a role", lambda e: _chat(e, [{"role": "user", "content": None}])),
    "an image part": (
        400,
        "must have a role",
        lambda e: _chat(e, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    ),
    "too many messages": (400, "--max-messages", lambda e: _chat(e, ASK * 33)),
    "a prompt past the engine's length": (400, "--max-len", lambda e: _chat(e, _content("5" * (MAX_LEN + 10)))),
    "a lone surrogate": (
        400,
        "could not be tokenized",
        lambda e: _raw(e, b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ),
    "the last message the assistant's": (
        400,
        "the last message is the assistant",
        lambda e: _chat(e, [*ASK, {"role": "assistant", "content": "3"}]),
    ),
    # parameters
    "n=2": (400, "one choice per request", lambda e: _chat(e, n=2)),
    "stream": (400, "not streamed", lambda e: _chat(e, stream=True)),
    "negative max_tokens": (400, "max_tokens must be a positive integer", lambda e: _chat(e, max_tokens=-1)),
    "fractional max_tokens": (400, "max_tokens must be a positive integer", lambda e: _chat(e, max_tokens=2.5)),
    "max_tokens a string": (400, "max_tokens must be a positive integer", lambda e: _chat(e, max_tokens="8")),
    "max_tokens a boolean": (400, "max_tokens must be a positive integer", lambda e: _chat(e, max_tokens=True)),
    "another temperature": (400, "differs from the server's", lambda e: _chat(e, temperature=0.3)),
    "temperature a string": (400, "differs from the server's", lambda e: _chat(e, temperature="hot")),
    "temperature NaN": (
        400,
        "differs from the server's",
        lambda e: _raw(e, b'{"messages": [{"role": "user", "content": "1"}], "temperature": NaN}'),
    ),
    # rewards and order
    "reward a string": (400, "finite number", lambda e: _reward(e, {"reward": "high"})),
    "reward NaN": (400, "finite number", lambda e: _reward(e, b'{"reward": NaN}')),
    "reward infinite": (400, "finite number", lambda e: _reward(e, b'{"reward": -Infinity}')),
    "reward missing": (400, "finite number", lambda e: _reward(e, {})),
    "reward a boolean": (400, "finite number", lambda e: _reward(e, {"reward": True})),
    "reward for an unknown episode": (404, "no episode", lambda e: e.post("/v1/episodes/nope/reward", {"reward": 1})),
    "reward twice": (409, "has ended", lambda e: _ended(e, "reward")),
    "a turn after the reward": (409, "has ended", lambda e: _ended(e, "turn")),
    "a reply edited": (400, "message 1 differs", lambda e: _not_continuing(e, "edited")),
    "a conversation repeated with nothing new": (
        400,
        "the last message is the assistant",
        lambda e: _not_continuing(e, "repeated"),
    ),
    "a conversation cut short": (400, "no new one", lambda e: _not_continuing(e, "shorter")),
    "a conversation reordered": (400, "message 0 differs", lambda e: _not_continuing(e, "reordered")),
    "an episode idle past the timeout": (410, "expired after 60 s without a request", _expired),
    # floods
    "open episodes past the limit": (429, "--max-episodes 48", _flood_opens),
    # hostile but valid: answered
    "40 turns at once": (200, "", _flood_turns),
    "a client that hangs up mid-turn": (200, "", _gone_mid_turn),
    "max_tokens of 10**30": (200, "", lambda e: _chat(e, max_tokens=10**30)),
    "NUL and control characters": (200, "", lambda e: _chat(e, _content("\x00\x01\x7f12"))),
    "unknown fields": (200, "", lambda e: _chat(e, tools=[{"type": "function"}], logprobs=True, seed=3, user="u")),
    "text parts and extra message fields": (
        200,
        "",
        lambda e: _chat(
            e,
            [{"role": "user", "name": "x", "content": [{"type": "text", "text": "1"}, {"type": "text", "text": "2"}]}],
        ),
    ),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_hostile_request_gets_one_answer(endpoint, kind):
    want, says, send = KINDS[kind]
    endpoint.skew += IDLE_S + 1  # the episodes earlier kinds left open have expired by now
    status, body = send(endpoint)
    assert status == want, body
    if want == 200:
        assert body.get("choices") or body.get("episode_id"), body
        return
    error = body["error"]
    assert set(error) == {"message", "type", "code"} and error["code"] == want
    assert "\n" not in error["message"] and len(error["message"]) <= 500, error["message"]
    assert says in error["message"]


def test_after_every_hostile_kind_a_normal_episode_still_runs(endpoint):
    assert len(KINDS) >= 30
    for kind in KINDS:  # when run alone, the hostile kinds run first
        endpoint.skew += IDLE_S + 1
        KINDS[kind][2](endpoint)
    assert endpoint.loop.is_alive() and endpoint.web.is_alive(), "the engine's thread and the server are up"
    episode = endpoint.episode()
    client = openai.OpenAI(base_url=f"{endpoint.base}/episodes/{episode}", api_key="unused")
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "4"}]
    for _ in range(3):
        reply = client.chat.completions.create(model="llama-1m", messages=messages, max_tokens=5)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "tool", "content": "ok"},
        ]
    assert endpoint.post(f"/v1/episodes/{episode}/reward", {"reward": 1.0})[0] == 200
    trajectory = endpoint.request("GET", f"/v1/episodes/{episode}")[1]
    assert trajectory["turns"] == 3 and trajectory["reward"] == 1.0 and trajectory["error"] is None
    server = endpoint.server
    assert len(server.episodes) <= server.limits.max_episodes and len(server.ended) <= server.limits.ended
    assert sum(len(k.context) for k in server.engine.kept.values()) <= server.kept_tokens
