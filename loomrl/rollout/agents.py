"""Agents trained as they are: each episode is an agent's own loop against an OpenAI-compatible endpoint that the
rollout engine serves in this process (:mod:`loomrl.rollout.openai_api`).

Every agent runs on a thread of its own with ``base_url`` naming its episode, from the conversation its ``reset``
gave (the episode's prompt); the engine runs on the calling thread, decoding every agent's pending turn together
over kept caches, until every agent has returned or ``step_timeout_s`` per turn, for ``max_turns`` + 1 turns, has
passed. An agent returns the episode's reward (or reports it with ``POST {base_url}/reward``). The episodes come back
as an environment's would: the exact sampled tokens and log-probs, the observation tokens (everything the agent
added between turns, through the chat template) masked, the reward. Tokens depend on each episode's random stream
and what its agent sent, not on the agents' timing.

A misbehaving agent ends only its own episode, with reward 0 and its finish counted in the run's episode metrics
(``episode/finish_<why>``): ``agent_error`` for an agent that raised or gave no valid reward, ``agent_timeout`` for
one still running at the deadline, ``error`` for a turn the engine failed on. The endpoint holds the agents to the
serving limits (:class:`~loomrl.rollout.serving.ServingLimits`), at most one open episode each.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from transformers import PreTrainedTokenizerBase

from loomrl.errors import DataError
from loomrl.rollout.engine import RolloutEngine
from loomrl.rollout.episodes import Episode, EpisodeSettings
from loomrl.rollout.serving import EpisodeServer, ServingLimits


def run_agents(
    engine: RolloutEngine,
    episodes: Sequence[Episode],
    tokenizer: PreTrainedTokenizerBase,
    decode: Callable[[list[int]], str],
    settings: EpisodeSettings,
    agent_name: str = "agent",
) -> list[Episode]:
    """Run every episode's agent (``episode.env``) to its end; returns the episodes, filled in, in order."""
    import uvicorn

    from loomrl.rollout.openai_api import create_app

    budget = max(ep.budget for ep in episodes)
    deadline_s = settings.step_timeout_s * (settings.max_turns + 1)
    limits = ServingLimits(max_episodes=len(episodes), ended=len(episodes), idle_timeout_s=0, turn_timeout_s=deadline_s)
    server = EpisodeServer(
        engine, tokenizer, decode, budget, turn_tokens=settings.turn_tokens, max_turns=settings.max_turns, limits=limits
    )
    http = uvicorn.Server(uvicorn.Config(create_app(server, "policy"), host="127.0.0.1", port=0, log_level="error"))
    web = threading.Thread(target=http.run, name="agent-endpoint", daemon=True)
    web.start()
    while not http.started:
        if not web.is_alive():
            raise DataError(f"{agent_name}: the rollout endpoint could not start on 127.0.0.1")
        threading.Event().wait(0.01)
    base = f"http://127.0.0.1:{http.servers[0].sockets[0].getsockname()[1]}/v1"
    pool = ThreadPoolExecutor(max_workers=max(1, settings.workers), thread_name_prefix="agent")
    runs = {}
    deadline = time.monotonic() + deadline_s
    try:
        for ep in episodes:
            eid = server.open(str(ep.sample_id), ep.sample_id, ep.prompt, ep.key)
            url = f"{base}/episodes/{eid}"
            runs[eid] = (ep, pool.submit(ep.env.run, url, [dict(m) for m in ep.opening]))
        server.run(lambda: all(f.done() for _, f in runs.values()) or time.monotonic() > deadline)
    finally:
        http.should_exit = True
        pool.shutdown(wait=False, cancel_futures=True)
    for eid, (ep, future) in runs.items():
        served = server.episode(eid)
        why = served.finish if served.error else None
        if why is None and not served.ended:
            why = "agent_timeout" if not future.done() else _report(server, eid, future)
        ep.tokens, ep.logps, ep.mask = served.tokens, served.logps, served.mask
        ep.turns, ep.finish = served.turns, why or served.finish
        ep.reward = 0.0 if why else served.reward
    web.join(timeout=10)
    return list(episodes)


def _report(server: EpisodeServer, episode_id: str, future) -> str | None:
    """Record the reward an agent returned; None if it did, else why its episode ends with none."""
    try:
        reward = future.result()
        if reward is None:
            return "agent_error"  # it returned no reward and reported none
        server.finish(episode_id, reward)
    except Exception:
        return "agent_error"
    return None
