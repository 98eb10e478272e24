"""Multi-turn episodes: the rollout engine generates each assistant turn, an environment answers it, and the
episode continues over its kept cache until the environment ends it or a budget does.

Many episodes run at once. When an episode's turn ends (eos, a stop token or its turn budget), its text goes to
its environment's ``step`` on a thread pool while the engine goes on decoding the others: an episode waiting on
its environment holds neither a decode row nor a slot (its keys and values wait outside the slots, see
:class:`~loomrl.rollout.engine.RolloutEngine`), and when the observation comes back the episode is resubmitted
with its whole history as prefix, so only the observation's tokens are prefilled. The engine steps whenever it
has work and blocks on the environments only when it has none.

An episode's response is every token after its prompt: the assistant's sampled tokens (``mask`` 1, with their
log-probs) and the observations' tokens (``mask`` 0, log-prob 0), exactly the ids the model read, so training
sees the sequence generation saw, with no re-tokenisation of text. Observation messages become tokens through
the tokenizer's chat template (:class:`ObservationTokens`). Tokens depend only on each episode's random stream,
its environment's replies and the model, never on which episodes were generated together or which environment
answered first.

The episode's reward is the sum of its steps' rewards. Each step's reward is also kept where it was earned, on the
last token of the turn it answers (:meth:`Episode.token_rewards`), for the ``turn`` credit rule; under the
``episode`` rule the policy-gradient algorithms give the sum to the whole episode, as they give a single
response's score to the whole response (``rollout.env.credit``,
:func:`~loomrl.algorithms.advantages.credit_by_turn`). An episode that runs out of its token
budget before its environment ends it is truncated there, and with ``at_budget='penalise'`` also loses
``budget_penalty``. An environment step that outlives ``step_timeout_s`` ends its episode (finish
``timeout``); one that raises stops the call with a one-line error naming the environment. The seconds its
steps took are the episode's ``env_s`` metric.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from loomrl.errors import DataError
from loomrl.models.tokenizer import encode_prompt
from loomrl.rollout.engine import Completion, Request, RolloutEngine

AT_BUDGET = ("truncate", "penalise")
FINISHES = ("done", "turns", "budget", "timeout")
"""Why an episode ended: its environment ended it, its turns or token budget ran out, or a step took too long."""


@dataclass(frozen=True)
class EpisodeSettings:
    """How episodes run (``rollout.env`` in a run's config)."""

    max_turns: int = 4
    """Assistant turns per episode at most."""
    turn_tokens: int = 0
    """Tokens one assistant turn may sample at most; 0: up to the episode's token budget."""
    at_budget: str = "truncate"
    """An episode that reaches its token budget unfinished: 'truncate' it there, or 'penalise' it too."""
    budget_penalty: float = 1.0
    """Taken from the reward of an episode cut by its token budget under ``at_budget='penalise'``."""
    step_timeout_s: float = 30.0
    """Seconds an environment step may take; a slower one ends its episode."""
    workers: int = 8
    """Threads running environment steps."""
    tool_format: str = "auto"
    """A tool environment's call format ('auto': the chat template's convention, else the environment's own; see
    :func:`~loomrl.envs.tool_calls.resolve_tool_format`)."""
    keep_cache: bool = True
    """Continue an episode over its kept cache; False: prefill its whole history again each turn (the baseline
    that keeping the cache is measured against)."""


@dataclass
class Episode:
    """One episode's state: its environment, its tokens so far, and how it ended."""

    sample_id: int
    prompt: list[int]
    key: int
    budget: int
    """Response tokens (sampled and observed) the episode may hold."""
    env: Any
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    """1 for a sampled token, 0 for an observation's."""
    reward: float = 0.0
    earned: dict[int, float] = field(default_factory=dict)
    """Step rewards by where they were earned: the index in ``tokens`` of the last token of the turn answered."""
    turns: int = 0
    finish: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    turn_start: int = 0
    """Where the current assistant turn begins in ``tokens``."""
    opening: list[dict[str, str]] = field(default_factory=list)
    """The conversation's start (its environment's reset): what an agent (:mod:`loomrl.rollout.agents`) starts
    from."""

    def add_reward(self, reward: float) -> None:
        """A step's reward, earned by the turn that just ended (the last of ``tokens``)."""
        self.reward += float(reward)
        if reward and self.tokens:
            at = len(self.tokens) - 1
            self.earned[at] = self.earned.get(at, 0.0) + float(reward)

    def token_rewards(self) -> list[float]:
        """The step rewards on the tokens that earned them (0 elsewhere); what they do not add up to of
        ``reward`` (a budget penalty, an agent's reported reward) is the advantage estimators' to place."""
        out = [0.0] * len(self.tokens)
        for at, reward in self.earned.items():
            out[at] += reward
        return out

    def request(self, turn_tokens: int, keep_cache: bool = True) -> Request:
        """The engine request for the episode's next turn: its history as prefix, its cache kept."""
        room = self.budget - len(self.tokens)
        turn = min(room, turn_tokens) if turn_tokens else room
        prefix, logps = list(self.tokens), list(self.logps)
        return Request(self.sample_id, self.prompt, self.key, len(self.tokens) + turn, prefix, logps, keep_cache)


class ObservationTokens:
    """Observation messages → the tokens that follow an assistant turn's last token, as the chat template renders
    them: the messages' own turns and the next assistant turn's header (ChatML: ``\\n<|im_start|>tool\\n...
    <|im_end|>\\n<|im_start|>assistant\\n``). Found as what the template adds to a conversation ending in an
    assistant turn, after that turn's end-of-turn token (one of ``turn_end_ids``, which end a sampled turn), so
    the tokens are those a re-rendered conversation would hold. Without a chat template, the messages' text."""

    _BASE = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]

    def __init__(self, tokenizer: PreTrainedTokenizerBase, turn_end_ids: Sequence[int]):
        self.tokenizer, self.turn_end_ids = tokenizer, frozenset(turn_end_ids)
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        if self.templated:
            base = self._render(self._BASE, generation_prompt=False)
            ends = [i for i, t in enumerate(base) if t in self.turn_end_ids]
            if not ends:
                raise DataError(
                    "the chat template ends an assistant turn with none of the tokens that end a sampled turn "
                    f"({sorted(self.turn_end_ids)}): observations cannot follow it"
                )
            self._cut = ends[-1] + 1
            self._base = base[: self._cut]

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def __call__(self, messages: Sequence[dict[str, str]]) -> list[int]:
        if not self.templated:
            return self.tokenizer.encode("".join(m["content"] for m in messages), add_special_tokens=False)
        full = self._render([*self._BASE, *(dict(m) for m in messages)], generation_prompt=True)
        if full[: self._cut] != self._base:
            raise DataError("the chat template renders a conversation's start differently once more turns follow")
        return full[self._cut :]


def conversation_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]]) -> list[int]:
    """An episode's prompt: its environment's first messages through the chat template with the generation
    prompt (:func:`~loomrl.models.tokenizer.encode_prompt`); without a template, bos and the messages' text, as
    observations are rendered then (:class:`~loomrl.rollout.episodes.ObservationTokens`)."""
    if getattr(tokenizer, "chat_template", None):
        return encode_prompt(tokenizer, messages)
    return encode_prompt(tokenizer, "".join(m["content"] for m in messages))


def scripted_episode(
    env: Any,
    opening: Sequence[dict[str, str]],
    turns: Sequence[str],
    tokenizer: PreTrainedTokenizerBase,
    observe: Callable[[Sequence[dict[str, str]]], list[int]],
    turn_end: int,
) -> Episode:
    """The episode a model would have had by sampling ``turns`` (each followed by ``turn_end``) in ``env``, reset
    to ``opening``: a demonstration to learn from, laid out token for token as :func:`run_episodes` lays out a
    sampled one (``mask`` 1 on the turns' tokens, 0 on the observations'). A turn after the environment ended the
    episode is a one-line error."""
    ep = Episode(-1, conversation_ids(tokenizer, opening), 0, 0, env)
    for i, text in enumerate(turns):
        if ep.finish:
            raise DataError(f"demonstration: turn {i} comes after the environment ended the episode")
        sampled = [*tokenizer.encode(text, add_special_tokens=False), turn_end]
        ep.tokens += sampled
        ep.mask += [1] * len(sampled)
        ep.turns += 1
        result = env.step(text)
        ep.add_reward(result.reward)
        if result.done:
            ep.finish = "done"
            continue
        observed = observe(result.messages) if i + 1 < len(turns) else []
        ep.tokens += observed
        ep.mask += [0] * len(observed)
    ep.logps = [0.0] * len(ep.tokens)
    ep.budget = len(ep.tokens)
    return ep


def run_episodes(
    engine: RolloutEngine,
    episodes: Sequence[Episode],
    observe: Callable[[Sequence[dict[str, str]]], list[int]],
    decode: Callable[[list[int]], str],
    settings: EpisodeSettings,
    env_name: str = "environment",
) -> list[Episode]:
    """Run every episode to its end (see the module docstring); returns them, in the order given."""
    by_id = {ep.sample_id: ep for ep in episodes}
    stepping: dict[Future, tuple[Episode, float]] = {}
    pool = ThreadPoolExecutor(max_workers=max(1, settings.workers), thread_name_prefix="env-step")

    def end(ep: Episode, why: str) -> None:
        ep.finish = why
        engine.release([ep.sample_id])
        if why == "budget" and settings.at_budget == "penalise":
            ep.reward -= settings.budget_penalty

    def turn_ended(c: Completion) -> None:
        ep = by_id[c.sample_id]
        new = c.tokens[len(ep.tokens) :]
        ep.tokens += new
        ep.logps += c.logps[len(ep.logps) :]
        ep.mask += [1] * len(new)
        ep.turns += 1
        if c.finish_reason == "length" and len(ep.tokens) >= ep.budget:
            end(ep, "budget")
            return
        text = decode(ep.tokens[ep.turn_start :])
        stepping[pool.submit(_timed, ep.env.step, text)] = (ep, time.monotonic())

    def stepped(ep: Episode, future: Future) -> None:
        try:
            result, seconds = future.result()
        except Exception as exc:
            raise DataError(f"{env_name}: step raised {type(exc).__name__}: {exc}") from exc
        ep.metrics["env_s"] = ep.metrics.get("env_s", 0.0) + seconds
        ep.add_reward(result.reward)
        for name, value in result.metrics.items():
            ep.metrics[name] = ep.metrics.get(name, 0.0) + float(value)
        if result.done:
            return end(ep, "done")
        if ep.turns >= settings.max_turns:
            return end(ep, "turns")
        observed = observe(result.messages)
        if len(ep.tokens) + len(observed) >= ep.budget:  # no room left to answer the observation
            return end(ep, "budget")
        ep.tokens += observed
        ep.logps += [0.0] * len(observed)
        ep.mask += [0] * len(observed)
        ep.turn_start = len(ep.tokens)
        engine.submit([ep.request(settings.turn_tokens, settings.keep_cache)])

    try:
        engine.submit([ep.request(settings.turn_tokens, settings.keep_cache) for ep in episodes])
        while engine.has_work() or stepping:
            for c in engine.step() if engine.has_work() else ():
                turn_ended(c)
            if stepping and not engine.has_work():  # nothing to decode: wait for the environments
                _gather(stepping, settings)
            now = time.monotonic()
            for future, (ep, started) in list(stepping.items()):
                if future.done():
                    del stepping[future]
                    stepped(ep, future)
                elif now - started > settings.step_timeout_s:
                    del stepping[future]  # the thread cannot be stopped; its result is ignored
                    end(ep, "timeout")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return list(episodes)


def _gather(stepping: dict[Future, tuple[Episode, float]], settings: EpisodeSettings) -> None:
    """Wait, with nothing to decode, for the first environment step to finish, then a little longer for the steps
    that started with it: a fifth of its duration (at least 2 ms). Episodes whose turns ended together come back
    together and are prefilled and decoded together; admitted one by one, they would fall out of step, and every
    engine step would decode fewer of them."""
    oldest = min(t for _, t in stepping.values())
    left = settings.step_timeout_s - (time.monotonic() - oldest)
    done, rest = wait(list(stepping), timeout=max(left, 0.0), return_when=FIRST_COMPLETED)
    if done and rest:
        first = min(stepping[f][1] for f in done)
        grace = max(0.002, 0.2 * (time.monotonic() - first))
        wait(rest, timeout=min(grace, max(left, 0.0)))


def _timed(step: Callable[[str], Any], text: str) -> tuple[Any, float]:
    """An environment step's result and its seconds (the run's ``episode/env_s``: what the planner prices)."""
    start = time.perf_counter()
    result = step(text)
    return result, time.perf_counter() - start
