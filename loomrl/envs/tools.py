"""Tool-using environments: a turn with tool calls gets their results, a turn without one is the final answer.

A subclass names its tools (functions of keyword arguments returning text), starts the conversation (``reset``)
and scores the final answer (``score``). Calls are read in ``tool_format`` (:mod:`loomrl.envs.tool_calls`); a call
that cannot be read, names no known tool, has wrong arguments or raises comes back as an ``error: ...`` tool
message for the model to mend, never as an exception. Per episode the metrics count ``tool_calls`` and
``tool_errors``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

from loomrl.envs.base import Message, StepResult
from loomrl.envs.tool_calls import HERMES, parse_tool_calls

RESULT_CHARS = 400
"""A tool's result is cut to this many characters."""


class ToolEnvironment(ABC):
    """Base of tool-using environments (see the module docstring)."""

    tool_format: str = HERMES
    """How calls are read (:func:`~loomrl.envs.tool_calls.parse_tool_calls`) and, in a prompt's example or a
    demonstration, written: the environment's own convention. A run sets it from ``rollout.env.tool_format``
    (:func:`~loomrl.envs.tool_calls.resolve_tool_format`: the setting, else the chat template's convention, else
    this)."""

    def __init__(self) -> None:
        self.tools: Mapping[str, Callable[..., str]] = {}

    @abstractmethod
    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        """The conversation's start for one dataset row."""

    @abstractmethod
    def score(self, answer: str) -> float:
        """The reward of the final answer (a turn without tool calls)."""

    def step(self, assistant_text: str) -> StepResult:
        parsed = parse_tool_calls(assistant_text, self.tool_format)
        if not parsed.calls and not parsed.errors:
            return StepResult([], self.score(parsed.content), True)
        messages = [self._tool_message(f"error: {error}") for error in parsed.errors]
        failed = len(parsed.errors)
        for call in parsed.calls:
            result, ok = self._run(call.name, call.arguments)
            messages.append(self._tool_message(result))
            failed += not ok
        return StepResult(messages, 0.0, False, {"tool_calls": float(len(parsed.calls)), "tool_errors": float(failed)})

    def _run(self, name: str, arguments: Mapping[str, Any]) -> tuple[str, bool]:
        tool = self.tools.get(name)
        if tool is None:
            return f"error: no tool named {name!r} (tools: {', '.join(sorted(self.tools))})", False
        try:
            if set(arguments) == {"input"}:  # a call read by a regular expression: its text, as the one argument
                return str(tool(arguments["input"]))[:RESULT_CHARS], True
            return str(tool(**arguments))[:RESULT_CHARS], True
        except TypeError as exc:
            return f"error: wrong arguments for {name}: {exc}"[:RESULT_CHARS], False
        except Exception as exc:  # a tool's failure is the model's observation, not the run's
            return f"error: {type(exc).__name__}: {exc}"[:RESULT_CHARS], False

    @staticmethod
    def _tool_message(content: str) -> Message:
        return {"role": "tool", "content": content}
