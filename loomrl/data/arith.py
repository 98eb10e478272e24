"""Arithmetic for chat models, and the final-number reward that GSM8K-style data is scored by.

:class:`Arithmetic` (``task.name=arith``) asks a question in words and rewards a response whose last number is the
answer, whatever is written around it ("57 + 5 = 62." is right, "62" is right, "11" is wrong). Its levels:

    1  What is 57 + 5?                a two-digit number plus a one-digit one
    2  What is 38 - 17?               a two-digit number plus or minus a two-digit one
    3  What is 418 * 7?               + - * of up to three digits (the factor of a product at most 12)
    4  Ann has 12 boxes of 7 pens and gives away 15. How many pens does she have left?   two steps in words

Every prompt ends with "Reply with the number only." Prompts are text: a tokenizer with a chat template renders
each as one user message (:func:`loomrl.models.tokenizer.encode_prompt`).

:func:`final_number` reads the number a response ends with (commas inside a number allowed: "1,024");
:func:`reference_answer` reads a reference answer, GSM8K's "<reasoning> #### 72" included. :func:`compute_score` is
the same rule as a reward function in verl's form (``reward_model.ground_truth``), and :func:`final_number_reward`
in loomrl's, for prompt files: ``task.reward_fn=loomrl.data.arith:compute_score``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from loomrl.data.tasks import Example, Task
from loomrl.errors import DataError

__all__ = ["Arithmetic", "compute_score", "final_number", "final_number_reward", "reference_answer"]

LEVELS = (1, 2, 3, 4)

INSTRUCTION = "Reply with the number only."

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")
"""A number as people write them: digits with an optional sign and decimals, or thousands separated by commas."""


def final_number(text: str) -> float | None:
    """The last number written in ``text``; None when there is none."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    return float(found[-1].replace(",", ""))


def reference_answer(answer: str) -> float | None:
    """The number a reference answer states: what follows GSM8K's ``####`` when there is one, else its last
    number."""
    head, mark, tail = answer.rpartition("####")
    return final_number(tail if mark else head + tail)


def final_number_reward(prompt: str, response: str, answer: str | None) -> float:
    """1.0 when the response's last number equals the reference answer's, else 0.0 (loomrl's reward form)."""
    if answer is None:
        raise DataError(f"final-number reward: prompt {prompt!r} has no reference answer (add an answer column)")
    want = reference_answer(answer)
    if want is None:
        raise DataError(f"final-number reward: reference answer {answer!r} holds no number")
    got = final_number(response)
    return 1.0 if got is not None and abs(got - want) < 1e-9 else 0.0


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """:func:`final_number_reward` in verl's form: ``ground_truth`` is the row's ``reward_model.ground_truth``."""
    return final_number_reward("", solution_str, str(ground_truth))


_NAMES = ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana")
_ITEMS = ("pens", "apples", "stamps", "marbles", "cards", "shells")
_BOXES = ("boxes", "bags", "packs", "jars")


@dataclass(frozen=True)
class Arithmetic(Task):
    """Arithmetic questions in words at a level of difficulty (module docstring); the reward reads the response's
    last number: 1.0 when it is the answer, else 0.0."""

    level: int = 1
    """1: a two-digit number plus a one-digit one; 2: ± of two two-digit numbers; 3: + - × of up to three digits;
    4: two-step word problems."""

    name: ClassVar[str] = "arith"
    answer_chars: ClassVar[str] = "0123456789"

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise DataError(f"task 'arith': level={self.level} (valid: {', '.join(map(str, LEVELS))})")

    def sample(self, rng: random.Random) -> Example:
        question, answer = (_word_problem if self.level == 4 else _expression)(rng, self.level)
        return Example(prompt=f"{question} {INSTRUCTION}", answer=str(answer))

    def solve(self, prompt: str) -> str:
        match = re.fullmatch(rf"What is (\d+) ([-+*]) (\d+)\? {re.escape(INSTRUCTION)}", prompt)
        if match is None:
            raise DataError(f"task 'arith': no reference answer for prompt {prompt!r} (give the example's answer)")
        return str(_value(int(match[1]), match[2], int(match[3])))

    def score(self, prompt: str, response: str, answer: str | None) -> float:
        return final_number_reward(prompt, response, answer if answer is not None else self.solve(prompt))


def _expression(rng: random.Random, level: int) -> tuple[str, int]:
    """'What is a op b?' and its value; never a negative result."""
    if level == 1:
        op, a, b = "+", rng.randint(10, 99), rng.randint(1, 9)
    elif level == 2:
        op, a, b = rng.choice("+-"), rng.randint(10, 99), rng.randint(10, 99)
    else:
        op = rng.choice("+-*")
        a = rng.randint(2, 999)
        b = rng.randint(2, 12) if op == "*" else rng.randint(2, 999)
    if op == "-" and b > a:
        a, b = b, a
    return f"What is {a} {op} {b}?", _value(a, op, b)


def _value(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _word_problem(rng: random.Random, level: int) -> tuple[str, int]:
    """A two-step problem: groups of items, then some bought or given away."""
    name, item, box = rng.choice(_NAMES), rng.choice(_ITEMS), rng.choice(_BOXES)
    groups, each = rng.randint(2, 9), rng.randint(2, 12)
    total = groups * each
    if rng.random() < 0.5:
        more = rng.randint(1, 30)
        return (
            f"{name} has {groups} {box} of {each} {item} and buys {more} more {item}. "
            f"How many {item} does {name} have now?",
            total + more,
        )
    fewer = rng.randint(1, total - 1)
    return (
        f"{name} has {groups} {box} of {each} {item} and gives away {fewer} {item}. "
        f"How many {item} does {name} have left?",
        total - fewer,
    )
