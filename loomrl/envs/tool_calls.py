"""Tool calls read from a model's text, in the convention of its chat template or by a regular expression.

Three conventions are read and written (:data:`CONVENTIONS`); a chat template that defines tools names its own
(:func:`template_convention`), and ``rollout.env.tool_format: auto`` uses it:

- ``hermes``: Qwen2.5/Qwen3, Hermes and most templates with tools (and what SmolLM2, whose template defines none,
  can be taught): each call a JSON object in tags,
  ``<tool_call>{"name": "calculator", "arguments": {"expression": "57 + 5"}}</tool_call>``.
- ``json``: Llama 3.1-3.3's JSON tool calling: the turn is the call, ``{"name": "calculator", "parameters":
  {...}}`` (after ``<|python_tag|>`` where the model writes one), or a JSON list of such objects.
- ``mistral``: ``[TOOL_CALLS]`` and a JSON list of calls (``[{"name": ..., "arguments": {...}}]``), or, in newer
  templates, ``[TOOL_CALLS]name[ARGS]{...}`` for each call; text before ``[TOOL_CALLS]`` is the turn's content.

In every convention a call's arguments are read from ``arguments`` or ``parameters`` (a JSON object, or a string
holding one). Any other format is a regular expression whose matches are calls: a group named ``name`` (else the
call's name is empty and the environment decides) and a group named ``arguments`` (else the first group, else the
whole match), read as a JSON object when it starts with ``{`` and otherwise passed as ``{"input": text}``, e.g.
``<calc>(?P<arguments>.*?)</calc>``. A call that cannot be read is an error in :attr:`ParsedTurn.errors` (the
environment returns it as an observation, the model's to mend), never an exception.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from loomrl.errors import DataError

HERMES, JSON, MISTRAL = "hermes", "json", "mistral"
CONVENTIONS = (HERMES, JSON, MISTRAL)
"""The tool-call conventions read (and written, for demonstrations) by name."""
AUTO = "auto"
"""``rollout.env.tool_format``'s default: the chat template's convention, else the environment's own."""

_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_TAG = "[TOOL_CALLS]"
_MISTRAL_ARGS = "[ARGS]"
_TEMPLATE_MARKS = (  # what a chat template that defines tools writes, per convention (first match wins)
    ("<tool_call>", HERMES),
    (_MISTRAL_TAG, MISTRAL),
    (_PYTHON_TAG, JSON),
    ('"parameters": dictionary of argument name', JSON),
)


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


def template_convention(chat_template: str | None) -> str | None:
    """The tool-call convention a chat template defines (one of :data:`CONVENTIONS`), or None where it defines
    none (e.g. SmolLM2's)."""
    if not chat_template:
        return None
    return next((convention for mark, convention in _TEMPLATE_MARKS if mark in chat_template), None)


def resolve_tool_format(setting: str, chat_template: str | None, own: str) -> str:
    """The format calls are read in: ``setting`` (``rollout.env.tool_format``) unless it is :data:`AUTO`, then the
    chat template's convention, else the environment's ``own``."""
    if setting != AUTO:
        return setting
    return template_convention(chat_template) or own


def format_tool_call(name: str, arguments: Mapping[str, Any], fmt: str) -> str:
    """One call written in convention ``fmt`` (what a demonstration or a prompt's example shows the model)."""
    if fmt == HERMES:
        return f"<tool_call>{json.dumps({'name': name, 'arguments': dict(arguments)})}</tool_call>"
    if fmt == JSON:
        return json.dumps({"name": name, "parameters": dict(arguments)})
    if fmt == MISTRAL:
        return f"{_MISTRAL_TAG}{json.dumps([{'name': name, 'arguments': dict(arguments)}])}"
    raise DataError(
        f"tool call format {fmt!r}: a regular expression reads calls but cannot write one; a demonstration or an "
        f"example call needs one of {', '.join(CONVENTIONS)}"
    )


def parse_tool_calls(text: str, fmt: str = HERMES) -> ParsedTurn:
    """The tool calls in ``text`` by ``fmt`` (a convention or a regular expression; see the module docstring)."""
    if fmt == HERMES:
        return _parse_hermes(text)
    if fmt == JSON:
        return _parse_json(text)
    if fmt == MISTRAL:
        return _parse_mistral(text)
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
        raise DataError(
            f"tool call format {fmt!r}: not one of {', '.join(CONVENTIONS)} nor a valid regular expression ({exc})"
        ) from exc


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


def _add_object(parsed: ParsedTurn, call: Any) -> None:
    """A call written as a JSON object ``{"name": ..., "arguments" or "parameters": {...}}``."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        parsed.errors.append('tool call needs a "name" (a string)')
        return
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        parsed.errors.append('tool call "arguments" must be a JSON object')
        return
    parsed.calls.append(ToolCall(call["name"], arguments))


def _add_json(parsed: ParsedTurn, raw: str) -> None:
    """A JSON call or list of calls."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        parsed.errors.append(f"tool call is not valid JSON ({exc.msg} at character {exc.pos})")
        return
    for call in value if isinstance(value, list) else [value]:
        _add_object(parsed, call)


def _parse_hermes(text: str) -> ParsedTurn:
    parsed = ParsedTurn()
    for match in _HERMES_CALL.finditer(text):
        _add_json(parsed, match.group(1).strip())
    rest = _HERMES_CALL.sub("", text)
    if "<tool_call>" in rest:
        parsed.errors.append("tool call is not closed with </tool_call>")
        rest = rest[: rest.index("<tool_call>")]
    parsed.content = rest.strip()
    return parsed


def _parse_json(text: str) -> ParsedTurn:
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    body = body.removeprefix(_PYTHON_TAG).strip()
    if not tagged and not body.startswith(("{", "[")):
        return ParsedTurn(content=body)  # no call: the turn is an answer
    parsed = ParsedTurn()
    _add_json(parsed, body)
    return parsed


def _parse_mistral(text: str) -> ParsedTurn:
    if _MISTRAL_TAG not in text:
        return ParsedTurn(content=text.strip())
    head, _, body = text.partition(_MISTRAL_TAG)
    parsed = ParsedTurn(content=head.strip())
    body = body.strip()
    if body.startswith(("{", "[")):
        _add_json(parsed, body)
        return parsed
    decoder = json.JSONDecoder()
    for part in body.split(_MISTRAL_TAG):  # name[ARGS]{...}, one per tag
        name, found, raw = part.partition(_MISTRAL_ARGS)
        if not found:
            parsed.errors.append(f"tool call {part.strip()[:40]!r} has no {_MISTRAL_ARGS} before its arguments")
            continue
        try:
            arguments, _ = decoder.raw_decode(raw.strip())
        except json.JSONDecodeError as exc:
            parsed.errors.append(f"tool call arguments are not valid JSON ({exc.msg} at character {exc.pos})")
            continue
        _add_object(parsed, {"name": name.strip(), "arguments": arguments})
    return parsed
