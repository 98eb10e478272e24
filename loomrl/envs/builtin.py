"""Built-in environments: a calculator tool and a Python tool for arithmetic questions, and a guessing game.

- ``calculator`` (:class:`Calculator`): the arithmetic task with a tool that evaluates ``+ - * /`` and parentheses
  (read with ``ast``, never ``eval``); the final answer's last number is checked against the row's answer.
- ``python`` (:class:`PythonTool`): the same questions with a tool that runs Python in the sandbox
  (:mod:`loomrl.data.sandbox`) and returns what it prints.
- ``guess`` (:class:`GuessingGame`): a two-player game for the built-in character tokenizer (no chat template, no
  JSON): the row's answer is a secret integer between the row's ``low`` and ``high`` (0 and 9 by default); each
  turn's last integer is a guess, answered ``higher``, ``lower`` or ``correct`` (reward 1, done).
"""

from __future__ import annotations

import ast
import operator
import re
from abc import abstractmethod
from collections.abc import Mapping
from typing import Any

from loomrl.data.arith import final_number, reference_answer
from loomrl.data.sandbox import SandboxLimits, run_python
from loomrl.envs.base import Message, StepResult
from loomrl.envs.tool_calls import format_tool_call
from loomrl.envs.tools import ToolEnvironment
from loomrl.errors import DataError

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_SIGNS = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPRESSION = 200


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (numbers, ``+ - * /``, signs, parentheses) as text: an integer
    without ``.0``. Anything else is refused with a ValueError."""
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from exc

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _SIGNS:
            return _SIGNS[type(node.op)](value(node.operand))
        raise ValueError(f"only numbers, + - * / and parentheses are allowed, not {type(node).__name__}")

    result = value(tree.body)
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def _question(row: Mapping[str, Any]) -> str:
    return str(row.get("question") or row["prompt"])


def _expression(row: Mapping[str, Any]) -> str:
    """The arithmetic a question asks for ('What is 57 + 5? ...' → '57 + 5'), for a demonstration."""
    match = re.search(r"What is ([-+*/() \d.]+)\?", _question(row))
    if match is None:
        raise DataError(f"no demonstration for {_question(row)!r}: it asks for no 'What is <arithmetic>?'")
    return match[1].strip()


def _answer_text(row: Mapping[str, Any]) -> str:
    value = reference_answer(str(row.get("answer")))
    if value is None:
        raise DataError(f"no demonstration for {_question(row)!r}: its answer {row.get('answer')!r} is no number")
    return str(int(value)) if value.is_integer() else str(value)


def _right(content: str, answer: Any) -> float:
    want = reference_answer(str(answer)) if answer is not None else None
    got = final_number(content)
    return float(want is not None and got is not None and abs(got - want) < 1e-6)


class _ArithmeticTool(ToolEnvironment):
    """An arithmetic question with one tool: the system message teaching the call (its example written in the
    environment's ``tool_format``), the question, the final number scored against the answer, and a demonstration
    (the call, then the answer)."""

    SYSTEM = ""
    """The system message; ``{call}`` is the example call of 57 + 5."""
    TOOL = ""

    def __init__(self) -> None:
        super().__init__()
        self.answer: Any = None

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        self.answer = row.get("answer")
        system = self.SYSTEM.format(call=format_tool_call(self.TOOL, self.arguments("57 + 5"), self.tool_format))
        return [{"role": "system", "content": system}, {"role": "user", "content": _question(row)}]

    def score(self, answer: str) -> float:
        return _right(answer, self.answer)

    @abstractmethod
    def arguments(self, expression: str) -> dict[str, str]:
        """The tool's arguments that compute ``expression`` (a demonstration's call)."""

    def demonstrate(self, row: Mapping[str, Any]) -> list[str]:
        """The turns of a correct episode: the tool call, then the answer (for supervised warm starts)."""
        return [format_tool_call(self.TOOL, self.arguments(_expression(row)), self.tool_format), _answer_text(row)]


class Calculator(_ArithmeticTool):
    """Arithmetic questions with a calculator tool (see the module docstring)."""

    SYSTEM = (
        "You can use a calculator. To use it, write a call like this and nothing else:\n"
        "{call}\n"
        "You will get the result. Then reply with the number only."
    )
    TOOL = "calculator"

    def __init__(self) -> None:
        super().__init__()
        self.tools = {"calculator": calculate}

    def arguments(self, expression: str) -> dict[str, str]:
        return {"expression": expression}


class PythonTool(_ArithmeticTool):
    """Arithmetic questions with a sandboxed Python tool (see the module docstring)."""

    SYSTEM = (
        "You can run Python. To run code, write a call like this and nothing else:\n"
        "{call}\n"
        "You will get what it prints. Then reply with the number only."
    )
    TOOL = "python"
    LIMITS = SandboxLimits(cpu_s=2, wall_s=5)

    def __init__(self) -> None:
        super().__init__()
        self.tools = {"python": self.python}

    def python(self, code: str) -> str:
        result = run_python(code, limits=self.LIMITS)
        return result.stdout if result.ok else result.describe()

    def arguments(self, expression: str) -> dict[str, str]:
        return {"code": f"print({expression})"}


class GuessingGame:
    """Guess the secret integer in as few turns as the episode allows (see the module docstring)."""

    def __init__(self) -> None:
        self.secret, self.low, self.high = 0, 0, 9

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        self.secret = int(row["answer"])
        self.low, self.high = int(row.get("low", 0)), int(row.get("high", 9))
        return [{"role": "user", "content": f"guess {self.low} {self.high}:"}]

    def demonstrate(self, row: Mapping[str, Any]) -> list[str]:
        """The turns of a binary search for the secret (for supervised warm starts)."""
        secret, low, high = int(row["answer"]), int(row.get("low", 0)), int(row.get("high", 9))
        turns = []
        while True:
            guess = (low + high) // 2
            turns.append(str(guess))
            if guess == secret:
                return turns
            low, high = (guess + 1, high) if guess < secret else (low, guess - 1)

    def step(self, assistant_text: str) -> StepResult:
        found = re.findall(r"-?\d+", assistant_text)
        if not found:
            return StepResult([{"role": "user", "content": " no guess:"}], 0.0, False, {"no_guess": 1.0})
        guess = int(found[-1])
        if guess == self.secret:
            return StepResult([], 1.0, True)
        return StepResult([{"role": "user", "content": " higher:" if guess < self.secret else " lower:"}])


BUILTIN_ENVIRONMENTS: dict[str, type] = {"calculator": Calculator, "guess": GuessingGame, "python": PythonTool}
"""The environments ``rollout.env.name`` knows by name."""
