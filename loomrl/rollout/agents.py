"""Agents trained as they are: each episode is an agent's own loop against an OpenAI-compatible endpoint that the
rollout engine serves in this process (:mod:`loomrl.rollout.openai_api`).

Every agent runs on a thread of its own with ``base_url`` naming its episode, from the conversation its ``reset``
gave (the episode's prompt); the engine runs on the calling thread, decoding every agent's pending turn together
over kept caches, until every agent has returned (within ``step_timeout_s`` per turn, for ``max_turns`` + 1 turns;
an agent still running then stops the call with a one-line error). An agent returns the episode's reward (or reports
it with ``POST {base_url}/reward``). The episodes come back as an environment's would: the exact sampled tokens and
log-probs, the observation tokens (everything the agent added between turns, through the chat template) masked, the
reward. Tokens depend on each episode's random stream and what its agent sent, not on the agents' timing.
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
from loomrl.rollout.serving import EpisodeServer


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
    server = EpisodeServer(
        engine, tokenizer, decode, budget, turn_tokens=settings.turn_tokens, max_turns=settings.max_turns
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
    deadline = time.monotonic() + settings.step_timeout_s * (settings.max_turns + 1)

    def finished() -> bool:
        if all(future.done() for _, future in runs.values()):
            return True
        if time.monotonic() > deadline:
            late = sorted(ep.sample_id for ep, future in runs.values() if not future.done())
            raise DataError(
                f"{agent_name}: the agents of samples {late[:8]} did not finish within "
                f"{deadline - started:.0f} s (rollout.env.step_timeout_s per turn, for max_turns + 1 turns)"
            )
        return False

    started = time.monotonic()
    try:
        for ep in episodes:
            eid = server.open(str(ep.sample_id), ep.sample_id, ep.prompt, ep.key)
            url = f"{base}/episodes/{eid}"
            runs[eid] = (ep, pool.submit(ep.env.run, url, [dict(m) for m in ep.opening]))
        server.run(finished)
    finally:
        http.should_exit = True
        pool.shutdown(wait=False, cancel_futures=True)
    for eid, (ep, future) in runs.items():
        try:
            reward = future.result()
        except Exception as exc:
            line = f"{type(exc).__name__}: {exc}".splitlines()[0]
            raise DataError(f"{agent_name}: the agent of sample {ep.sample_id} raised {line}") from exc
        served = server.episodes[eid]
        if not served.ended:
            if reward is None:
                raise DataError(
                    f"{agent_name}: the agent of sample {ep.sample_id} returned no reward and reported none "
                    "(return it from run, or POST {base_url}/reward)"
                )
            server.finish(eid, reward)
        ep.tokens, ep.logps, ep.mask = served.tokens, served.logps, served.mask
        ep.reward, ep.turns, ep.finish = served.reward, served.turns, served.finish
    web.join(timeout=10)
    return list(episodes)
