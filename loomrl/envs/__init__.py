"""Environments of multi-turn rollouts: the protocol, tool calls, and the built-in environments."""

from loomrl.envs.base import Agent, Environment, Message, StepResult, env_row
from loomrl.envs.builtin import BUILTIN_ENVIRONMENTS, Calculator, GuessingGame, PythonTool, calculate
from loomrl.envs.loading import is_agent, load_environment
from loomrl.envs.tool_calls import (
    CONVENTIONS,
    HERMES,
    ParsedTurn,
    ToolCall,
    format_tool_call,
    parse_tool_calls,
    resolve_tool_format,
    template_convention,
)
from loomrl.envs.tools import ToolEnvironment

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "CONVENTIONS",
    "Agent",
    "HERMES",
    "Calculator",
    "Environment",
    "GuessingGame",
    "Message",
    "ParsedTurn",
    "PythonTool",
    "StepResult",
    "ToolCall",
    "ToolEnvironment",
    "calculate",
    "env_row",
    "format_tool_call",
    "is_agent",
    "load_environment",
    "parse_tool_calls",
    "resolve_tool_format",
    "template_convention",
]
