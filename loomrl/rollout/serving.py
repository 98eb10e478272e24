"""Episodes driven from outside: an agent's chat requests become turns of an episode in the rollout engine.

Agents written against an OpenAI-compatible server (:mod:`loomrl.rollout.openai_api` serves this over HTTP) send
the whole conversation each turn. The server keeps each episode's exact token ids and log-probs instead of
re-tokenising the text it gets back: the first request's messages are the prompt (through the chat template);
every later request must repeat the episode's conversation so far (the messages it sent and the replies it got,
word for word) and add new messages (tool results, the user's reply), whose tokens are appended as an
observation (:class:`~loomrl.rollout.episodes.ObservationTokens`), masked out of training; the reply is sampled
over the episode's kept cache. The agent reports the episode's reward (:meth:`EpisodeServer.finish`), which ends
it; its trajectory (:meth:`EpisodeServer.trajectory`) is then what a multi-turn environment's episode would be:
prompt ids, the response's tokens with their log-probs and mask, and the reward.

Many agents run at once: their turns wait in a queue that the engine's thread (:meth:`EpisodeServer.run`) drains
between decode steps, so all live turns decode together. Nothing an agent sends can stop that thread or grow the
server without bound (:class:`ServingLimits`): a request is checked (its messages, its tokens against the engine's
``max_len``) before it reaches the engine; an engine error during a turn ends that turn's episode with an error
answer and the others go on; open episodes are counted and expire when idle, ended ones are forgotten oldest first,
and the kept caches of episodes waiting on their agents share one token budget. Refusals raise
:class:`EndpointError`, one line with an HTTP status.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from loomrl.rollout.engine import Completion, Request, RolloutEngine
from loomrl.rollout.episodes import Episode, ObservationTokens, conversation_ids
from loomrl.rollout.sampling import stream_keys

ROLES = ("system", "user", "assistant", "tool")
MAX_ID_CHARS = 128
"""The longest episode id the server accepts (ids are echoed in errors and kept while their episode is)."""


class EndpointError(Exception):
    """A request the server refuses: one line, and the HTTP status that says why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class EngineFailure(Exception):
    """The engine raised while it ran one episode's turn; that episode ends, the server goes on."""


@dataclass(frozen=True)
class ServingLimits:
    """What one request and the server's state may hold. Each is a flag of ``loomrl serve-rollouts``, named in
    the refusal a request past it gets."""

    max_body_bytes: int = 1 << 20
    """A request body's bytes, at most (--max-body-bytes); larger ones get 413 before they are read whole."""
    max_messages: int = 256
    """Messages in one request, at most (--max-messages)."""
    max_episodes: int = 1024
    """Episodes open at once, at most (--max-episodes); opening another gets 429."""
    idle_timeout_s: float = 600.0
    """An open episode with no request for this long expires (--idle-timeout); 0: never."""
    kept_tokens: int = 0
    """Tokens of the kept caches of episodes waiting on their agents, together (--kept-tokens); past it the least
    recently used are dropped, and those episodes' next turns prefill their whole context. 0: the engine's
    ``slots × max_len``."""
    ended: int = 1024
    """Ended episodes whose trajectories can still be read, the newest (--max-episodes as well)."""
    turn_timeout_s: float = 600.0
    """A turn not answered within this long gets 504 and is dropped; the episode goes on."""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_messages", "max_episodes", "ended"):
            if getattr(self, name) < 1:
                raise ValueError(f"serving limit {name}: must be at least 1, got {getattr(self, name)}")
        for name in ("idle_timeout_s", "kept_tokens", "turn_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"serving limit {name}: must be at least 0, got {getattr(self, name)}")


@dataclass
class ServedEpisode(Episode):
    """An episode (its trajectory so far: :class:`~loomrl.rollout.episodes.Episode`) that an agent drives: its id,
    its conversation as the server has seen it, whether it has ended and whether a turn is in flight."""

    episode_id: str = ""
    messages: list[bytes] = field(default_factory=list)
    """A digest of each of the requests' messages and the server's replies: what a later request must repeat."""
    ended: bool = False
    busy: bool = False
    last_seen: float = 0.0
    """When its last request came or was answered (the server's clock): it expires idle from there."""
    error: str | None = None
    """Why the engine ended it, if it did."""

    def trajectory(self) -> dict[str, Any]:
        return {
            "episode_id": self.episode_id,
            "prompt_ids": list(self.prompt),
            "response_ids": list(self.tokens),
            "logprobs": list(self.logps),
            "mask": list(self.mask),
            "turns": self.turns,
            "reward": self.reward if self.ended and self.error is None else None,
            "ended": self.ended,
            "error": self.error,
        }


@dataclass
class Turn:
    """One request in flight: the episode it belongs to, the engine request, and the future it is answered on."""

    episode: ServedEpisode
    request: Request
    digests: list[bytes]
    """The request's messages, digested (:attr:`ServedEpisode.messages` once it is answered)."""
    observed: int
    """Observation tokens the request appends before the turn."""
    future: Future = field(default_factory=Future)


class EpisodeServer:
    """Turns chat requests into episode turns on ``engine`` (see the module docstring). ``max_tokens`` bounds an
    episode's response (sampled and observed tokens); a request's ``max_tokens`` bounds its turn, else
    ``turn_tokens`` (0: the episode's room); ``max_turns`` (0: any) bounds its turns. A prompt and its turns fit
    the engine's ``max_len`` or are refused."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: PreTrainedTokenizerBase,
        decode: Callable[[list[int]], str],
        max_tokens: int,
        seed: int = 0,
        iteration: int = 0,
        encode: Callable[[list[dict[str, str]]], list[int]] | None = None,
        on_end: Callable[[dict[str, Any]], None] | None = None,
        turn_tokens: int = 0,
        max_turns: int = 0,
        limits: ServingLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.engine, self.decode, self.max_tokens = engine, decode, max_tokens
        self.turn_tokens, self.max_turns = turn_tokens, max_turns
        self.limits, self.clock = limits or ServingLimits(), clock
        """``clock()``: seconds, what idle episodes expire by (a test's own clock)."""
        self.kept_tokens = self.limits.kept_tokens or engine.slots * engine.max_len
        self.seed, self.iteration, self.on_end = seed, iteration, on_end
        """``on_end(trajectory)`` hears of every episode that ends with a reward (e.g. to write it down)."""
        self.encode = encode or (lambda messages: conversation_ids(tokenizer, messages))
        self.observe = ObservationTokens(tokenizer, [*engine.eos_ids, *engine.params.stop_ids])
        self.episodes: dict[str, ServedEpisode] = {}
        """Open episodes, by id."""
        self.ended: OrderedDict[str, ServedEpisode] = OrderedDict()
        """Ended episodes, the newest ``limits.ended``, oldest first."""
        self.gone: OrderedDict[str, str] = OrderedDict()
        """Why each recently forgotten episode is gone (expired, or ended and dropped), for a clear refusal."""
        self._next_sample = 0
        self._pending: dict[int, Turn] = {}
        """Sample id → the turn the engine runs for it."""
        self._inbox: queue.Queue[Turn | int] = queue.Queue()
        """Turns to start, and the sample ids of episodes that ended or whose turn timed out: their turn in flight,
        if any, is aborted and their kept cache dropped."""
        self._lock = threading.Lock()
        self._swept = self.clock()
        self.counts = {"engine_errors": 0, "expired": 0, "refused": 0}
        """Turns the engine failed on, episodes expired idle, and opens refused at the limit: what a log reports."""

    # ------------------------------------------------------------------------------------------ episodes
    def open(
        self,
        episode_id: str | None = None,
        sample_id: int | None = None,
        prompt: list[int] | None = None,
        key: int | None = None,
    ) -> str:
        """Start an episode (a fresh id unless one is given) and return its id. ``sample_id`` names its random
        stream (by default the next number; ``key``: the stream's key, by default that of the server's seed and
        iteration); with ``prompt``, its first request must render to those ids."""
        if episode_id is not None and (
            not episode_id or len(episode_id) > MAX_ID_CHARS or not episode_id.isprintable()
        ):
            raise EndpointError(400, f"episode_id must be 1 to {MAX_ID_CHARS} printable characters")
        with self._lock:
            self._expire(self.clock())
            if len(self.episodes) >= self.limits.max_episodes:
                self.counts["refused"] += 1
                raise EndpointError(
                    429,
                    f"{len(self.episodes)} episodes are open, the limit (--max-episodes "
                    f"{self.limits.max_episodes}); end one (POST its reward) or let idle ones expire "
                    f"(--idle-timeout {self.limits.idle_timeout_s:g} s)",
                )
            episode_id = episode_id or uuid.uuid4().hex
            if episode_id in self.episodes or episode_id in self.ended:
                raise EndpointError(409, f"episode '{episode_id}' exists already")
            self.gone.pop(episode_id, None)
            if sample_id is None:
                sample_id, self._next_sample = self._next_sample, self._next_sample + 1
            key = int(stream_keys(self.seed, self.iteration, [sample_id])[0]) if key is None else key
            self.episodes[episode_id] = ServedEpisode(
                sample_id, list(prompt or []), key, self.max_tokens, None, episode_id=episode_id
            )
            self.episodes[episode_id].last_seen = self.clock()
            return episode_id

    def finish(self, episode_id: str, reward: Any) -> None:
        """Record the episode's reward; it ends the episode."""
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not abs(reward) < float("inf"):
            raise EndpointError(400, f"episode '{_shown(episode_id)}': reward must be a finite number, got {reward!r}")
        with self._lock:
            ep = self._live(episode_id)
            if ep.busy:
                raise EndpointError(409, f"episode '{_shown(episode_id)}' has a request in flight")
            ep.reward, ep.finish = float(reward), "done"
            self._end(ep)
            ended = ep.trajectory()
        if self.on_end is not None:
            self.on_end(ended)

    def trajectory(self, episode_id: str) -> dict[str, Any]:
        with self._lock:
            return self._known(episode_id).trajectory()

    def episode(self, episode_id: str) -> ServedEpisode:
        """An episode, open or ended (and not yet forgotten)."""
        with self._lock:
            return self._known(episode_id)

    def _end(self, ep: ServedEpisode) -> None:
        """End ``ep`` (the lock held): its cache is dropped on the engine's thread; the oldest ended are forgotten."""
        ep.ended = True
        self.episodes.pop(ep.episode_id, None)
        self.ended[ep.episode_id] = ep
        while len(self.ended) > self.limits.ended:
            old, _ = self.ended.popitem(last=False)
            self._forget(old, "ended, and its trajectory was dropped for newer ones")
        self._inbox.put(ep.sample_id)

    def _forget(self, episode_id: str, why: str) -> None:
        self.gone[episode_id] = why
        while len(self.gone) > 16 * self.limits.max_episodes:
            self.gone.popitem(last=False)

    def _expire(self, now: float) -> None:
        """Forget the open episodes idle past the timeout (the lock held)."""
        timeout = self.limits.idle_timeout_s
        if not timeout:
            return
        turn_timeout = self.limits.turn_timeout_s
        for ep in [e for e in self.episodes.values() if _idle(e, now, timeout, turn_timeout)]:
            del self.episodes[ep.episode_id]
            self._forget(ep.episode_id, f"expired after {timeout:g} s without a request (--idle-timeout)")
            self.counts["expired"] += 1
            self._inbox.put(ep.sample_id)

    def _known(self, episode_id: str) -> ServedEpisode:
        """An episode, open or ended, the lock held; one idle past the timeout expires here if not before."""
        ep = self.episodes.get(episode_id)
        if ep is not None and _idle(ep, self.clock(), self.limits.idle_timeout_s, self.limits.turn_timeout_s):
            self._expire(self.clock())
        ep = self.episodes.get(episode_id) or self.ended.get(episode_id)
        if ep is not None:
            return ep
        why = self.gone.get(episode_id)
        if why is not None:
            raise EndpointError(410, f"episode '{_shown(episode_id)}' {why}")
        raise EndpointError(404, f"no episode '{_shown(episode_id)}' (start one with POST /v1/episodes)")

    def _live(self, episode_id: str) -> ServedEpisode:
        """An open episode."""
        ep = self._known(episode_id)
        if ep.ended:
            why = f"the engine failed on it ({ep.error})" if ep.error else "its reward was reported"
            raise EndpointError(409, f"episode '{_shown(episode_id)}' has ended ({why})")
        return ep

    # --------------------------------------------------------------------------------------------- turns
    def chat(
        self,
        episode_id: str,
        messages: Any,
        max_tokens: Any = None,
        temperature: Any = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Sample the next assistant turn of ``episode_id`` for ``messages`` (the whole conversation); returns its
        ``content``, ``finish_reason`` ('stop' or 'length') and token counts. Blocks this thread; the HTTP face
        waits on :meth:`begin`'s future instead."""
        turn = self.begin(episode_id, messages, max_tokens, temperature)
        timeout = self.limits.turn_timeout_s if timeout_s is None else timeout_s
        try:
            completion = turn.future.result(timeout=timeout or None)
        except BaseException as exc:
            raise self.failed(turn, exc, timeout) from None
        return self.conclude(turn, completion)

    def begin(self, episode_id: str, messages: Any, max_tokens: Any = None, temperature: Any = None) -> Turn:
        """Check a turn's request, mark its episode busy and queue the turn on the engine; its ``future`` is
        answered with the engine's completion (then :meth:`conclude`) or an error (then :meth:`failed`)."""
        checked = _checked_messages(episode_id, messages, self.limits.max_messages)
        if temperature is not None and (
            isinstance(temperature, bool)
            or not isinstance(temperature, (int, float))
            or float(temperature) != self.engine.params.temperature
        ):
            raise EndpointError(
                400,
                f"temperature {temperature!r:.40} differs from the server's {self.engine.params.temperature} "
                "(trajectories are trained at the temperature they were sampled at; leave it out)",
            )
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            raise EndpointError(400, f"max_tokens must be a positive integer, got {max_tokens!r:.40}")
        digests = [_digest(m) for m in checked]
        with self._lock:
            ep = self._live(episode_id)
            if ep.busy:
                raise EndpointError(409, f"episode '{_shown(episode_id)}' has a request in flight")
            if self.max_turns and ep.turns >= self.max_turns:
                raise EndpointError(409, f"episode '{_shown(episode_id)}' has had its {self.max_turns} turns")
            new = self._continues(ep, digests)
            ep.busy, ep.last_seen = True, self.clock()
        try:  # tokenizing may take a while: outside the lock, the episode held busy meanwhile
            request, observed = self._request(ep, checked, new, max_tokens)
        except BaseException:
            with self._lock:
                ep.busy = False
            raise
        turn = Turn(ep, request, digests, observed)
        self._inbox.put(turn)
        return turn

    def conclude(self, turn: Turn, completion: Completion) -> dict[str, Any]:
        """Record a turn the engine answered; returns the reply (see :meth:`chat`)."""
        ep, request = turn.episode, turn.request
        new = completion.tokens[len(request.prefix) :]
        try:
            content = self.decode(new)
        except BaseException:
            with self._lock:
                ep.busy = False
            raise
        with self._lock:
            if not ep.prompt:
                ep.prompt = list(request.prompt)
            ep.tokens = list(completion.tokens)
            ep.logps = list(completion.logps)
            ep.mask += [0] * turn.observed + [1] * len(new)
            ep.messages = [*turn.digests, _digest({"role": "assistant", "content": content})]
            ep.turns += 1
            ep.busy, ep.last_seen = False, self.clock()
        return {
            "content": content,
            "finish_reason": "length" if completion.finish_reason == "length" else "stop",
            "prompt_tokens": len(request.prompt) + len(request.prefix),
            "completion_tokens": len(new),
        }

    def failed(self, turn: Turn, exc: BaseException, timeout_s: float) -> EndpointError:
        """The refusal for a turn that got no completion: a timeout drops the turn (the episode goes on, and its
        next turn prefills the whole history); an engine failure ends the episode."""
        ep = turn.episode
        with self._lock:
            ep.busy, ep.last_seen = False, self.clock()
            if isinstance(exc, EngineFailure):
                ep.error, ep.finish = str(exc), "error"
                if not ep.ended:
                    self._end(ep)
                return EndpointError(500, f"episode '{_shown(ep.episode_id)}' ended: the engine failed on it: {exc}")
        self._inbox.put(turn.request.sample_id)
        if isinstance(exc, TimeoutError):
            return EndpointError(504, f"episode '{_shown(ep.episode_id)}': no reply within {timeout_s:g} s")
        return EndpointError(503, f"episode '{_shown(ep.episode_id)}': the turn was dropped ({type(exc).__name__})")

    def _continues(self, ep: ServedEpisode, digests: list[bytes]) -> list[int] | None:
        """None for an episode's first request; else the indices of the new messages, after its conversation."""
        if not ep.messages:
            return None
        seen = len(ep.messages)
        differs = next((i for i, (a, b) in enumerate(zip(digests, ep.messages)) if a != b), None)
        if differs is not None or len(digests) <= seen:
            what = (
                f"message {differs} differs from what was sent or replied"
                if differs is not None
                else f"it has {seen} messages and no new one after them"
            )
            raise EndpointError(
                400, f"episode '{_shown(ep.episode_id)}': messages do not continue its conversation ({what})"
            )
        return list(range(seen, len(digests)))

    def _request(
        self, ep: ServedEpisode, messages: list[dict[str, str]], new: list[int] | None, max_tokens: int | None
    ) -> tuple[Request, int]:
        """The engine request of ``ep``'s next turn and how many observation tokens it appends; refused unless
        the engine can hold it."""
        name = _shown(ep.episode_id)
        try:
            if new is None:
                prompt, observed = self.encode(messages), []
            else:
                prompt, observed = ep.prompt, self.observe([messages[i] for i in new])
        except Exception as exc:
            line = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            raise EndpointError(400, f"episode '{name}': the messages could not be tokenized ({line})") from None
        if new is None and ep.prompt and prompt != ep.prompt:
            raise EndpointError(
                400,
                f"episode '{name}': the first request's messages are not the conversation it was given to start with",
            )
        prefix = ep.tokens + observed
        room = min(ep.budget - len(prefix), self.engine.max_len - len(prompt) - len(prefix))
        if room < 1:
            if len(prompt) + len(prefix) >= self.engine.max_len:
                raise EndpointError(
                    400,
                    f"episode '{name}': its context of {len(prompt) + len(prefix)} tokens leaves no room for a turn "
                    f"within the engine's {self.engine.max_len} (--max-len)",
                )
            raise EndpointError(400, f"episode '{name}' has used its {ep.budget} tokens (sampled and observed)")
        cap = max_tokens or self.turn_tokens
        turn = min(room, cap) if cap else room
        logps = ep.logps + [0.0] * len(observed)
        return Request(ep.sample_id, list(prompt), ep.key, len(prefix) + turn, prefix, logps, True), len(observed)

    # ---------------------------------------------------------------------------------------- the engine
    def warm(self) -> None:
        """One short generation before serving, on the engine's thread: the cache is allocated and the first
        forward's one-off costs are paid here, not by the first agent."""
        self.engine.generate([Request(-1, [self.engine.pad_id] * 4, 0, 2)])
        self.engine.release([-1])
        self.engine.step_log.clear()
        self.engine.finished_lengths.clear()

    def run(self, stop: Callable[[], bool]) -> None:
        """The engine's loop, on the thread that owns the model: take queued turns, decode, answer; until
        ``stop()`` holds with nothing left to decode. Nothing a request holds raises out of it."""
        while True:
            self._drain(block=not self.engine.has_work())
            if self.engine.has_work():
                self._step()
            elif stop():
                return
            self._tidy()

    def _step(self) -> None:
        try:
            done = self.engine.step()
        except Exception:
            self._isolate()
            return
        for completion in done:
            turn = self._pending.pop(completion.sample_id, None)
            if turn is not None:
                _answer(turn.future, completion)
        if done:
            self._trim_kept()

    def _isolate(self) -> None:
        """A step raised: run each turn it held alone, continuing where it stopped (its tokens are those of an
        uninterrupted run), so the turn that fails ends only its own episode."""
        try:
            stopped = {c.sample_id: c for c in self.engine.abort(list(self._pending))}
        except Exception:  # the engine's slots are past repair: every turn starts again from its request
            stopped = {}
            self.engine.waiting.clear()
            self.engine.live.clear()
        pending, self._pending = self._pending, {}
        for sid, turn in pending.items():
            request = turn.request
            if sid in stopped:
                c = stopped[sid]
                request = replace(request, prefix=list(c.tokens), prefix_logps=list(c.logps))
            try:
                self.engine.submit([request])
                done: list[Completion] = []
                while not done and self.engine.has_work():
                    done = [c for c in self.engine.step() if c.sample_id == sid]
                _answer(turn.future, done[0])
            except Exception as exc:
                self.engine.abort([sid])
                self.engine.release([sid])
                self.counts["engine_errors"] += 1
                _answer(turn.future, EngineFailure(f"{type(exc).__name__}: {exc}".splitlines()[0][:300]))

    def _drain(self, block: bool) -> None:
        try:  # the wait ends the moment a turn is queued; the timeout only paces the idle-episode sweep
            item = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        items = [item]
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for item in items:
            if isinstance(item, int):  # an episode that ended or expired, or whose turn timed out
                self.engine.abort([item])
                self.engine.release([item])
                self._pending.pop(item, None)
                continue
            if not item.future.set_running_or_notify_cancel():
                continue
            try:
                self.engine.submit([item.request])
            except Exception as exc:
                self.counts["engine_errors"] += 1
                _answer(item.future, EngineFailure(f"{type(exc).__name__}: {exc}".splitlines()[0][:300]))
                continue
            self._pending[item.request.sample_id] = item

    def _trim_kept(self) -> None:
        """Drop the least recently kept caches past the budget (the engine keeps them in the order they came)."""
        kept = self.engine.kept
        total = sum(len(k.context) for k in kept.values())
        while total > self.kept_tokens and kept:
            sid = next(iter(kept))
            total -= len(kept[sid].context)
            self.engine.release([sid])

    def _tidy(self) -> None:
        """Once a second: expire idle episodes; keep the engine's per-step logs (nobody reads them while it
        serves) from growing for as long as it serves."""
        now = self.clock()
        if now - self._swept < 1.0:
            return
        self._swept = now
        with self._lock:
            self._expire(now)
        if len(self.engine.step_log) > 10_000:
            del self.engine.step_log[:-1000]
        if len(self.engine.finished_lengths) > 10_000:
            del self.engine.finished_lengths[:-1000]


def _idle(ep: ServedEpisode, now: float, timeout: float, turn_timeout: float = 0.0) -> bool:
    """Whether ``ep`` has gone ``timeout`` seconds without a request; a turn in flight counts as a request for as
    long as a turn may take (``turn_timeout``; 0: any)."""
    if not timeout:
        return False
    quiet = now - ep.last_seen
    return quiet > timeout and (not ep.busy or (bool(turn_timeout) and quiet > timeout + turn_timeout))


def _answer(future: Future, outcome: Completion | BaseException) -> None:
    """Set a turn's outcome unless its waiter gave up on it."""
    try:
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    except InvalidStateError:
        pass


def _shown(episode_id: str) -> str:
    """An id as errors echo it: at most the length of a valid one."""
    return episode_id if len(episode_id) <= MAX_ID_CHARS else episode_id[:MAX_ID_CHARS] + "..."


def _digest(message: dict[str, str]) -> bytes:
    return hashlib.blake2b(json.dumps([message["role"], message["content"]]).encode(), digest_size=16).digest()


def _checked_messages(episode_id: str, messages: Any, limit: int) -> list[dict[str, str]]:
    """``messages`` as plain ``{"role", "content"}`` dicts, or a one-line 400 saying what is wrong."""
    name = _shown(episode_id)
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise EndpointError(400, f"episode '{name}': messages must be a non-empty list of messages")
    if len(messages) > limit:
        raise EndpointError(
            400, f"episode '{name}': {len(messages)} messages, over the limit of {limit} (--max-messages)"
        )
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # content parts: their text, in order
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            texts = [t for t in parts if isinstance(t, str)]
            content = "".join(texts) if len(texts) == len(content) else None
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str) or role not in ROLES or not isinstance(content, str):
            raise EndpointError(
                400, f"episode '{name}': message {i} must have a role ({', '.join(ROLES)}) and text content"
            )
        out.append({"role": role, "content": content})
    if out[-1]["role"] == "assistant":
        raise EndpointError(400, f"episode '{name}': the last message is the assistant's; nothing to answer")
    return out
