"""Configuration of multi-turn rollouts: the environment each episode talks to, and its budgets
(``rollout.env``; what they mean: :mod:`loomrl.rollout.episodes`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from loomrl.config.tools import ValidatedConfig, fail, spec

AT_BUDGET = ("truncate", "penalise")  # loomrl.rollout.episodes.AT_BUDGET
CREDIT = ("episode", "turn")
TOOL_CONVENTIONS = ("auto", "hermes", "json", "mistral")  # loomrl.envs.tool_calls: AUTO and CONVENTIONS


@dataclass(frozen=True)
class EnvConfig(ValidatedConfig):
    name: str | None = None
    """The environment of multi-turn rollouts: a built-in ('calculator', 'guess', 'python'), 'module:Class' or
    'path/to/file.py:Class'; None: one response per prompt, no environment. Each episode gets a fresh instance,
    reset with its prompt's row (prompt, answer and the prompt file's other columns), which also gives the
    prompt (its conversation's start); the episode's reward is the sum of its steps' rewards."""
    max_turns: int = spec(4, ge=1, le=1024)
    """Assistant turns per episode at most."""
    turn_tokens: int = spec(0, ge=0)
    """Tokens one assistant turn may sample at most; 0: up to the episode's budget (``rollout.max_new_tokens``,
    which counts every token after the prompt, the observations' too)."""
    at_budget: str = spec("truncate", choices=AT_BUDGET)
    """An episode that reaches rollout.max_new_tokens before its environment ends it: 'truncate' it there, or
    'penalise' it as well (its reward less ``budget_penalty``)."""
    budget_penalty: float = spec(1.0, ge=0)
    """What 'penalise' takes from the reward of an episode cut by its budget."""
    step_timeout_s: float = spec(30.0, gt=0)
    """Seconds an environment step may take; a slower one ends its episode (its reward so far)."""
    tool_format: str = "auto"
    """How a tool environment reads tool calls from a turn (and writes its example call and demonstrations):
    'auto' (the convention the tokenizer's chat template defines, else the environment's own: Hermes for the
    built-ins), 'hermes' (``<tool_call>{json}</tool_call>``), 'json' (Llama 3.x: the turn is a JSON call),
    'mistral' (``[TOOL_CALLS][...]``), or a regular expression whose matches are calls (groups ``name`` and
    ``arguments``; it reads calls but writes none; see loomrl.envs.tool_calls)."""
    credit: str = spec("episode", choices=CREDIT)
    """Which tokens a step's reward is credited to: 'episode' (every sampled token of the episode gets the
    episode's reward) or 'turn' (a token is credited with the rewards of its own turn's step and the steps after
    it, not those before: reward-to-go; see loomrl.algorithms.advantages.credit_by_turn)."""
    workers: int = spec(8, ge=1, le=1024)
    """Threads running environment steps, per generating device: episodes waiting on their environment do not
    hold the others' decoding."""

    def validate(self) -> None:
        if self.tool_format not in TOOL_CONVENTIONS:
            try:
                re.compile(self.tool_format)
            except re.error as exc:
                named = ", ".join(f"'{c}'" for c in TOOL_CONVENTIONS)
                fail("tool_format", f"{self.tool_format!r} is not one of {named} nor a regular expression ({exc})")

    @property
    def enabled(self) -> bool:
        return self.name is not None
