"""Tool calls read from a model's text: the Hermes convention, or a configured regular expression.

``hermes`` is what Qwen2.5/Qwen3, Hermes and most chat templates that define tools use (and what SmolLM2 can be
taught): each call a JSON object in tags,

    <tool_call>{"name": "calculator", "arguments": {"expression": "57 + 5"}}</tool_call>

Any other format is a regular expression whose matches are calls: a group named ``name`` (else the call's name is
empty and the environment decides) and a group named ``arguments`` (else the first group, else the whole match),
read as a JSON object when it starts with ``{`` and otherwise passed as ``{"input": text}``, e.g.
``<calc>(?P<arguments>.*?)</calc>``. A call that cannot be read is an error in :attr:`ParsedTurn.errors` (the
environment returns it as an observation, the model's to mend), never an exception.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

from loomrl.errors import DataError

HERMES = "hermes"
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedTurn:
    """What a turn's text holds: its calls, the calls that could not be read, and its text without them."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    content: str = ""


def parse_tool_calls(text: str, fmt: str = HERMES) -> ParsedTurn:
    """The tool calls in ``text`` by ``fmt`` (:data:`HERMES` or a regular expression; see the module docstring)."""
    if fmt == HERMES:
        return _parse_hermes(text)
    pattern = _compiled(fmt)
    parsed = ParsedTurn(content=pattern.sub("", text).strip())
    for match in pattern.finditer(text):
        groups = match.groupdict()
        raw = groups.get("arguments") or (match.group(1) if pattern.groups else match.group(0))
        name = (groups.get("name") or "").strip()
        _add_call(parsed, name, (raw or "").strip())
    return parsed


@functools.cache
def _compiled(fmt: str) -> re.Pattern[str]:
    try:
        return re.compile(fmt, re.DOTALL)
    except re.error as exc:
        raise DataError(f"tool call format {fmt!r}: not '{HERMES}' nor a valid regular expression ({exc})") from exc


def _add_call(parsed: ParsedTurn, name: str, raw: str) -> None:
    if not raw.startswith("{"):
        parsed.calls.append(ToolCall(name, {"input": raw}))
        return
    try:
        arguments = json.loads(raw)
    except json.JSONDecodeError as exc:
        parsed.errors.append(f"tool call arguments are not valid JSON ({exc.msg} at character {exc.pos})")
        return
    if not isinstance(arguments, dict):
        parsed.errors.append("tool call arguments must be a JSON object")
        return
    parsed.calls.append(ToolCall(name, arguments))


def _parse_hermes(text: str) -> ParsedTurn:
    parsed = ParsedTurn()
    for match in _HERMES_CALL.finditer(text):
        raw = match.group(1).strip()
        try:
            call = json.loads(raw)
        except json.JSONDecodeError as exc:
            parsed.errors.append(f"tool call is not valid JSON ({exc.msg} at character {exc.pos})")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            parsed.errors.append('tool call needs a "name" (a string)')
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            parsed.errors.append('tool call "arguments" must be a JSON object')
            continue
        parsed.calls.append(ToolCall(call["name"], arguments))
    rest = _HERMES_CALL.sub("", text)
    if "<tool_call>" in rest:
        parsed.errors.append("tool call is not closed with </tool_call>")
        rest = rest[: rest.index("<tool_call>")]
    parsed.content = rest.strip()
    return parsed
