"""The environment protocol of multi-turn rollouts, and how a run names its environment.

An environment is a small stateful object, one per episode::

    class Guess:
        def reset(self, row):                 # the conversation's start for one dataset row
            self.secret = int(row["answer"])
            return [{"role": "user", "content": "guess 0 9"}]

        def step(self, assistant_text):       # the assistant's turn, as text
            guess = ...                       # read it
            if guess == self.secret:
                return StepResult([], reward=1.0, done=True)
            return StepResult([{"role": "user", "content": "higher" if guess < self.secret else "lower"}])

``reset`` must be a function of its row: every sample of a GRPO group resets its own instance with the same row,
and the run built the prompt from that same reset. ``step`` answers with the messages to append (role ``tool`` for
a tool's result, ``user`` for a game's reply), this step's reward and whether the episode is over. The episode's
reward is the sum of its steps' rewards (the policy-gradient algorithms credit the sum to every sampled token of
the episode, as they credit a single response's score to the whole response); a step's ``metrics`` are summed per
episode and averaged over the batch into the run's ``episode/`` metrics.

Environments are named like reward functions (:func:`~loomrl.envs.loading.load_environment`): a built-in name,
``'module:Class'`` or ``'path/to/file.py:Class'``; the rollout engine calls ``step`` on a thread pool under a time
limit (``rollout.env.step_timeout_s``), and code a model wrote runs in the sandbox
(:class:`~loomrl.envs.builtin.PythonTool`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Message = dict[str, str]
"""One chat message: ``{"role": ..., "content": ...}``."""


@dataclass
class StepResult:
    """An environment's answer to one assistant turn."""

    messages: list[Message] = field(default_factory=list)
    """The observation: messages appended to the conversation (not trained on)."""
    reward: float = 0.0
    """This step's reward; the episode's is the sum over its steps."""
    done: bool = False
    """Whether the episode is over."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Numbers to report (summed per episode, averaged over the batch as ``episode/<name>``)."""


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        """The conversation's start for one dataset row (a deterministic function of the row)."""

    def step(self, assistant_text: str) -> StepResult:
        """Answer one assistant turn."""


@runtime_checkable
class Agent(Protocol):
    """An agent written against an OpenAI-compatible server, trained as it is: ``rollout.env.name`` names it like an
    environment. ``reset`` gives the conversation's start (the episode's prompt, a function of the row, as for an
    environment); ``run`` drives the episode with its own loop, e.g. ``openai.OpenAI(base_url=base_url)``
    starting from ``messages``, and returns the episode's reward (or reports it itself: ``POST
    {base_url}/reward``). The run serves ``base_url`` from its rollout engine
    (:mod:`loomrl.rollout.openai_api`), keeping every turn's exact tokens."""

    def reset(self, row: Mapping[str, Any]) -> list[Message]: ...

    def run(self, base_url: str, messages: list[Message]) -> float | None: ...


def env_row(prompt: str, answer: str | None, row: Mapping[str, Any]) -> dict[str, Any]:
    """What an environment's ``reset`` sees of an example: its ``prompt`` text, its ``answer`` and the prompt
    file's other columns (a column of the file named ``prompt`` or ``answer`` would be the same values)."""
    return {**row, "prompt": prompt, "answer": answer}
