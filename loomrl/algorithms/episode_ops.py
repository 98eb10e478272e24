"""The generate call of multi-turn rollouts: one episode per row, its environment answering each turn.

Each row gets a fresh environment from ``rollout.env.name``, reset with the row (:func:`~loomrl.envs.env_row`);
the conversation it starts must be the row's prompt (the trainer built the prompt from the same reset), so the
environment's reset has to be a function of its row. Episodes run in the rollout engine
(:func:`~loomrl.rollout.episodes.run_episodes`); the call returns, per row, the response (every token after the
prompt: sampled turns and observations), the sampled tokens' log-probs, the ``mask`` that keeps observation tokens
out of every loss, KL and advantage, the episode's reward as ``score`` (there is no separate reward call), its
turns and environment metrics for the rollout metrics, and, where ``rollout.env.credit`` is ``turn``, the step
rewards on the tokens that earned them (:data:`EARNED`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from loomrl.algorithms.context import OpContext
from loomrl.config.environment import EnvConfig
from loomrl.data.tasks import Example
from loomrl.envs import ToolEnvironment, env_row, is_agent, load_environment, resolve_tool_format
from loomrl.errors import DataError
from loomrl.models.tokenizer import decode_response
from loomrl.rollout import RolloutEngine, SamplingParams, generation_eos_ids, stream_keys
from loomrl.rollout.agents import run_agents
from loomrl.rollout.episodes import (
    Episode,
    EpisodeSettings,
    ObservationTokens,
    conversation_ids,
    run_episodes,
    scripted_episode,
)
from loomrl.workflow.batch import Batch, pad_right

EARNED = "earned_reward"
"""The column of step rewards on the tokens that earned them (:meth:`~loomrl.rollout.episodes.Episode.token_rewards`,
``rollout.env.credit: turn``); the advantage estimators credit by turn where a batch has it."""


def episode_settings(env: EnvConfig) -> EpisodeSettings:
    """How ``rollout.env``'s episodes run."""
    return EpisodeSettings(
        env.max_turns,
        env.turn_tokens,
        env.at_budget,
        env.budget_penalty,
        env.step_timeout_s,
        env.workers,
        env.tool_format,
    )


def open_episode(
    tokenizer: PreTrainedTokenizerBase, env: EnvConfig, example: Example
) -> tuple[object, list[dict[str, str]]]:
    """A fresh environment for ``example`` and the conversation its reset starts. A tool environment reads and
    writes calls in the run's format (:func:`~loomrl.envs.tool_calls.resolve_tool_format`: ``env.tool_format``,
    else the chat template's convention, else its own), set before the reset, whose prompt may show a call. Every
    place an episode starts (the prompt, sampling, evaluation, demonstrations) opens it here, so they agree."""
    assert env.name is not None, "an episode needs an environment"
    instance = load_environment(env.name)()  # the class is loaded once (load_environment caches it)
    if isinstance(instance, ToolEnvironment):
        template = getattr(tokenizer, "chat_template", None)
        instance.tool_format = resolve_tool_format(env.tool_format, template, instance.tool_format)
    return instance, instance.reset(env_row(example.prompt, example.answer, example.row))


def demonstrations(tokenizer: PreTrainedTokenizerBase, env: EnvConfig, examples: Sequence[Example]) -> list[Episode]:
    """Each example's demonstration in environment ``env`` (its ``demonstrate(row)`` turns, played through it),
    laid out token for token as a sampled episode (:func:`~loomrl.rollout.episodes.scripted_episode`): what a
    supervised warm start learns from, its loss on the turns' tokens only."""
    observe = ObservationTokens(tokenizer, [tokenizer.eos_token_id])
    out = []
    for ex in examples:
        instance, opening = open_episode(tokenizer, env, ex)
        demonstrate = getattr(instance, "demonstrate", None)
        if demonstrate is None:
            raise DataError(f"environment '{env.name}': has no demonstrate(row) method to learn demonstrations from")
        turns = demonstrate(env_row(ex.prompt, ex.answer, ex.row))
        out.append(scripted_episode(instance, opening, turns, tokenizer, observe, tokenizer.eos_token_id))
    return out


def env_prompt(tokenizer: PreTrainedTokenizerBase, env: EnvConfig, example: Example) -> list[int]:
    """The prompt of an episode on ``example``: the conversation ``env``'s reset starts, as token ids."""
    return conversation_ids(tokenizer, open_episode(tokenizer, env, example)[1])


def _run(
    model: PreTrainedModel,
    episodes: list[Episode],
    params: SamplingParams,
    eos_id: int,
    pad_id: int,
    tokenizer: PreTrainedTokenizerBase,
    decode,
    env: EnvConfig,
) -> None:
    longest = max(len(ep.prompt) for ep in episodes)
    eos_ids = (eos_id, *generation_eos_ids(model))
    engine = RolloutEngine(
        model, params, eos_ids, pad_id, slots=min(256, len(episodes)), max_len=longest + params.max_new_tokens
    )
    observe = ObservationTokens(tokenizer, [*engine.eos_ids, *params.stop_ids])
    was_training = model.training
    model.eval()
    try:
        settings = episode_settings(env)
        if is_agent(load_environment(env.name)):
            run_agents(engine, episodes, tokenizer, decode, settings, f"agent '{env.name}'")
        else:
            run_episodes(engine, episodes, observe, decode, settings, f"environment '{env.name}'")
    finally:
        model.train(was_training)


def episodes_op(ctx: OpContext, batch: Batch, params: SamplingParams, env: EnvConfig) -> dict:
    """Run one episode per row (see the module docstring); columns in row order."""
    assert ctx.tokenizer is not None, "episodes render observations with the run's tokenizer"
    keys = stream_keys(ctx.seed, ctx.iteration, batch.ids).tolist()
    rows = batch["row"] if "row" in batch else [{} for _ in batch.ids]
    episodes = []
    for sid, prompt, text, answer, row, key in zip(
        batch.ids, batch["prompt_ids"], batch["prompt_text"], batch["answer"], rows, keys
    ):
        instance, opening = open_episode(ctx.tokenizer, env, Example(text, answer, row=row))
        if conversation_ids(ctx.tokenizer, opening) != list(prompt):
            raise DataError(
                f"environment '{env.name}': reset gave sample {sid} a conversation other than its prompt's; reset "
                "must be a function of its row"
            )
        episodes.append(Episode(sid, list(prompt), key, params.max_new_tokens, instance, opening=list(opening)))
    _run(ctx.role.model, episodes, params, ctx.eos_id, ctx.pad_id, ctx.tokenizer, ctx.decode, env)
    rewards = [ep.reward for ep in episodes]
    out = {
        "response_ids": [ep.tokens for ep in episodes],
        "logp": pad_right([ep.logps for ep in episodes]),
        "mask": pad_right([ep.mask for ep in episodes]),
        "score": torch.tensor(rewards, dtype=torch.float32),
        "rule_scores": [(ep.reward, ep.finish == "done" and ep.reward > 0, {}) for ep in episodes],
        "episode_metrics": [
            {"turns": float(ep.turns), "observed_tokens": float(ep.mask.count(0)), f"finish_{ep.finish}": 1.0}
            | ep.metrics
            for ep in episodes
        ],
    }
    if env.credit == "turn":
        out[EARNED] = pad_right([ep.token_rewards() for ep in episodes])
    return out


def evaluate_episodes(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    env: EnvConfig,
    examples: Sequence[Example],
    max_new_tokens: int,
) -> dict[str, float]:
    """Greedy episodes on ``examples``: the share solved (ended by the environment with a positive reward), the
    mean reward and the mean number of turns."""
    episodes = []
    for i, ex in enumerate(examples):
        instance, opening = open_episode(tokenizer, env, ex)
        episodes.append(Episode(i, conversation_ids(tokenizer, opening), 0, max_new_tokens, instance, opening=opening))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    decode = partial(decode_response, tokenizer)
    _run(model, episodes, params, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer, decode, env)
    n = len(episodes)
    return {
        "exact_match": sum(ep.finish == "done" and ep.reward > 0 for ep in episodes) / n,
        "score": sum(ep.reward for ep in episodes) / n,
        "turns": sum(ep.turns for ep in episodes) / n,
    }
