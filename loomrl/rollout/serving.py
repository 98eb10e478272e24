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

Many agents run at once: their requests wait in a queue that the engine's thread (:meth:`EpisodeServer.run`)
drains between decode steps, so all live turns decode together. Bad requests raise :class:`EndpointError`, one line
with an HTTP status; the server goes on.
"""

from __future__ import annotations

import queue
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from loomrl.rollout.engine import Completion, Request, RolloutEngine
from loomrl.rollout.episodes import Episode, ObservationTokens, conversation_ids
from loomrl.rollout.sampling import stream_keys

ROLES = ("system", "user", "assistant", "tool")


class EndpointError(Exception):
    """A request the server refuses: one line, and the HTTP status that says why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class ServedEpisode(Episode):
    """An episode (its trajectory so far: :class:`~loomrl.rollout.episodes.Episode`) that an agent drives: its id,
    its conversation as the server has seen it, whether it has ended and whether a turn is in flight."""

    episode_id: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)
    """The requests' messages and the server's replies."""
    ended: bool = False
    busy: bool = False

    def trajectory(self) -> dict[str, Any]:
        return {
            "episode_id": self.episode_id,
            "prompt_ids": list(self.prompt),
            "response_ids": list(self.tokens),
            "logprobs": list(self.logps),
            "mask": list(self.mask),
            "turns": self.turns,
            "reward": self.reward if self.ended else None,
            "ended": self.ended,
        }


class EpisodeServer:
    """Turns chat requests into episode turns on ``engine`` (see the module docstring). ``max_tokens`` bounds an
    episode's response (sampled and observed tokens); a request's ``max_tokens`` bounds its turn, else
    ``turn_tokens`` (0: the episode's room); ``max_turns`` (0: any) bounds its turns."""

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
    ):
        self.engine, self.decode, self.max_tokens = engine, decode, max_tokens
        self.turn_tokens, self.max_turns = turn_tokens, max_turns
        self.seed, self.iteration, self.on_end = seed, iteration, on_end
        """``on_end(trajectory)`` hears of every episode that ends (e.g. to write it down for training)."""
        self.encode = encode or (lambda messages: conversation_ids(tokenizer, messages))
        self.observe = ObservationTokens(tokenizer, [*engine.eos_ids, *engine.params.stop_ids])
        self.episodes: dict[str, ServedEpisode] = {}
        self._pending: dict[int, Future] = {}
        """Sample id → the future its turn's request waits on."""
        self._inbox: queue.Queue[tuple[Request, Future] | int] = queue.Queue()
        """Turns to start (a request and its future), and the sample ids of episodes that ended or whose turn timed
        out: their turn in flight, if any, is aborted and their kept cache dropped."""
        self._lock = threading.Lock()
        self.failure: str | None = None

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
        with self._lock:
            episode_id = episode_id or uuid.uuid4().hex
            if episode_id in self.episodes:
                raise EndpointError(409, f"episode '{episode_id}' exists already")
            sample_id = len(self.episodes) if sample_id is None else sample_id
            key = int(stream_keys(self.seed, self.iteration, [sample_id])[0]) if key is None else key
            self.episodes[episode_id] = ServedEpisode(
                sample_id, list(prompt or []), key, self.max_tokens, None, episode_id=episode_id
            )
            return episode_id

    def finish(self, episode_id: str, reward: Any) -> None:
        """Record the episode's reward; it ends the episode."""
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise EndpointError(400, f"episode '{episode_id}': reward must be a number, got {reward!r}")
        with self._lock:
            ep = self._episode(episode_id)
            if ep.busy:
                raise EndpointError(409, f"episode '{episode_id}' has a request in flight")
            ep.reward, ep.ended, ep.finish = float(reward), True, "done"
            ended = ep.trajectory()
        self._inbox.put(ep.sample_id)  # its kept cache is dropped on the engine's thread
        if self.on_end is not None:
            self.on_end(ended)

    def trajectory(self, episode_id: str) -> dict[str, Any]:
        with self._lock:
            return self._get(episode_id).trajectory()

    def chat(
        self, episode_id: str, messages: Any, max_tokens: Any = None, temperature: Any = None, timeout_s: float = 600
    ) -> dict[str, Any]:
        """Sample the next assistant turn of ``episode_id`` for ``messages`` (the whole conversation); returns its
        ``content``, ``finish_reason`` ('stop' or 'length') and token counts."""
        checked = _checked_messages(episode_id, messages)
        if temperature is not None and (
            isinstance(temperature, bool)
            or not isinstance(temperature, (int, float))
            or float(temperature) != self.engine.params.temperature
        ):
            raise EndpointError(
                400,
                f"temperature {temperature} differs from the server's {self.engine.params.temperature} "
                "(trajectories are trained at the temperature they were sampled at; leave it out)",
            )
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            raise EndpointError(400, f"max_tokens must be a positive integer, got {max_tokens!r}")
        with self._lock:
            ep = self._episode(episode_id)
            if ep.busy:
                raise EndpointError(409, f"episode '{episode_id}' has a request in flight")
            request, observed = self._request(ep, checked, max_tokens)
            ep.busy = True
        future: Future = Future()
        self._inbox.put((request, future))
        try:
            completion: Completion = future.result(timeout=timeout_s)
        except TimeoutError:
            self._inbox.put(request.sample_id)  # the turn is dropped: the next one prefills the whole history
            raise EndpointError(504, f"episode '{episode_id}': no reply within {timeout_s:g} s") from None
        except Exception as exc:  # the engine failed: every request hears it, the server stays up
            raise EndpointError(500, f"generation failed: {type(exc).__name__}: {exc}") from None
        finally:
            with self._lock:
                ep.busy = False
        with self._lock:
            new = completion.tokens[len(request.prefix) :]
            if not ep.prompt:
                ep.prompt = list(request.prompt)
            ep.tokens = list(completion.tokens)
            ep.logps = list(completion.logps)
            ep.mask += [0] * observed + [1] * len(new)
            content = self.decode(new)
            ep.messages = [*checked, {"role": "assistant", "content": content}]
            ep.turns += 1
        return {
            "content": content,
            "finish_reason": "length" if completion.finish_reason == "length" else "stop",
            "prompt_tokens": len(request.prompt) + len(request.prefix),
            "completion_tokens": len(new),
        }

    def _request(
        self, ep: ServedEpisode, messages: list[dict[str, str]], max_tokens: int | None
    ) -> tuple[Request, int]:
        """The engine request of ``ep``'s next turn and how many observation tokens it appends."""
        if self.max_turns and ep.turns >= self.max_turns:
            raise EndpointError(409, f"episode '{ep.episode_id}' has had its {self.max_turns} turns")
        if not ep.messages:
            prompt, observed = self.encode(messages), []
            if ep.prompt and prompt != ep.prompt:
                raise EndpointError(
                    400,
                    f"episode '{ep.episode_id}': the first request's messages are not the conversation it was given "
                    "to start with",
                )
        else:
            seen = len(ep.messages)
            differs = next((i for i, (a, b) in enumerate(zip(messages, ep.messages)) if a != b), None)
            if differs is not None or len(messages) <= seen:
                what = (
                    f"message {differs} differs from what was sent or replied"
                    if differs is not None
                    else (f"it has {seen} messages and no new one after them")
                )
                raise EndpointError(
                    400, f"episode '{ep.episode_id}': messages do not continue its conversation ({what})"
                )
            new = messages[seen:]
            prompt, observed = ep.prompt, self.observe(new)
        room = ep.budget - len(ep.tokens) - len(observed)
        if room < 1:
            raise EndpointError(
                400, f"episode '{ep.episode_id}' has used its {ep.budget} tokens (sampled and observed)"
            )
        cap = max_tokens or self.turn_tokens
        turn = min(room, cap) if cap else room
        prefix = ep.tokens + observed
        logps = ep.logps + [0.0] * len(observed)
        return Request(ep.sample_id, list(prompt), ep.key, len(prefix) + turn, prefix, logps, True), len(observed)

    def _get(self, episode_id: str) -> ServedEpisode:
        ep = self.episodes.get(episode_id)
        if ep is None:
            raise EndpointError(404, f"no episode '{episode_id}' (start one with POST /v1/episodes)")
        return ep

    def _episode(self, episode_id: str) -> ServedEpisode:
        """A live episode: known and not ended."""
        ep = self._get(episode_id)
        if ep.ended:
            raise EndpointError(409, f"episode '{episode_id}' has ended (its reward was reported)")
        return ep

    # ---------------------------------------------------------------------------------------- the engine
    def run(self, stop: Callable[[], bool]) -> None:
        """The engine's loop, on the thread that owns the model: take queued turns, decode, answer; until
        ``stop()`` holds with nothing left to decode."""
        while True:
            self._drain(block=not self.engine.has_work())
            if self.engine.has_work():
                try:
                    done = self.engine.step()
                except Exception as exc:  # answer every waiting request with the failure
                    self.failure = f"{type(exc).__name__}: {exc}"
                    self.engine.abort(list(self._pending))
                    for future in self._pending.values():
                        future.set_exception(exc)
                    self._pending.clear()
                    continue
                for completion in done:
                    self._pending.pop(completion.sample_id).set_result(completion)
            elif stop():
                return

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.02) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        items = [item]
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for item in items:
            if isinstance(item, int):  # an episode that ended, or whose turn timed out
                self.engine.abort([item])
                self.engine.release([item])
                self._pending.pop(item, None)
                continue
            request, future = item
            self._pending[request.sample_id] = future
            self.engine.submit([request])


def _checked_messages(episode_id: str, messages: Any) -> list[dict[str, str]]:
    """``messages`` as plain ``{"role", "content"}`` dicts, or a one-line 400 saying what is wrong."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise EndpointError(400, f"episode '{episode_id}': messages must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # content parts: their text, in order
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            content = "".join(parts) if len(parts) == len(content) and all(isinstance(t, str) for t in parts) else None
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(content, str):
            raise EndpointError(
                400,
                f"episode '{episode_id}': message {i} must have a role ({', '.join(ROLES)}) and text content",
            )
        out.append({"role": m["role"], "content": content})
    if out[-1]["role"] == "assistant":
        raise EndpointError(400, f"episode '{episode_id}': the last message is the assistant's; nothing to answer")
    return out
