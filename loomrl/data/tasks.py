"""Synthetic tasks with checkable answers, small enough for a ~1M-parameter model to learn on CPU in minutes.

A task samples prompts, knows the correct answer, and scores a response with dense partial credit, so
RL has a reward signal before the policy is ever exactly right. Prompts and answers use only characters of
:data:`loomrl.models.tokenizer.TASK_ALPHABET`.

    sort 31415=   → 11345        SortDigits
    add 12+345=   → 357          AddNumbers
    rev abcd=     → dcba         ReverseWord

Partial credit (:func:`partial_credit`), for the response r stripped of surrounding whitespace and the
answer a, with m = max(len r, len a):

    score = 0.5 · (#positions i with r[i] == a[i]) / m  +  0.5 · min(len r, len a) / m

Both terms are 1 only when r == a, so the score is exactly 1.0 iff the response is exact and < 1 otherwise.
It is monotone: at a fixed length, each further correct character adds 0.5/m; moving the length towards
the answer's raises the second term. Positions are aligned from the left, the order in which a model emits
them. An empty response scores 0.
"""

from __future__ import annotations

import dataclasses
import random
import string
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from loomrl.errors import DataError


@dataclass(frozen=True)
class Example:
    """One prompt and, when known, its reference answer (the SFT target; None for reward-only data)."""

    prompt: str
    """The prompt's text; for a chat row, the content of its last user message (what rules and tables see)."""
    answer: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    """A chat row's conversation so far, as (role, content) turns; None for a plain text prompt."""
    row: Mapping[str, Any] = field(default_factory=dict)
    """A prompt file's row: its columns but the prompt's, by name, as read (what reward functions may ask for:
    ``solution``, verl's ``data_source``, ``reward_model``, ``extra_info``...); empty for a synthetic task."""

    @property
    def model_input(self) -> str | list[dict[str, str]]:
        """What the tokenizer encodes (:func:`loomrl.models.tokenizer.encode_prompt`): the conversation as
        ``{"role", "content"}`` messages for a chat row, else the prompt text."""
        if self.messages is None:
            return self.prompt
        return [{"role": role, "content": content} for role, content in self.messages]


def partial_credit(response: str, answer: str) -> float:
    """Dense similarity in [0, 1]; 1.0 exactly when ``response.strip() == answer`` (see module docstring)."""
    r = response.strip()
    longest = max(len(r), len(answer))
    if longest == 0:
        return 1.0  # both empty: equal
    matched = sum(1 for x, y in zip(r, answer) if x == y)
    return 0.5 * matched / longest + 0.5 * min(len(r), len(answer)) / longest


EXACT_SCORE = 1.0
"""A response is exactly right when its rule score is at least this (:meth:`Task.exact`): a built-in task's partial
credit is 1.0 only for the exact answer, and a user reward function gives 1.0 (or more) for a right one."""


@dataclass(frozen=True)
class BatchScores:
    """A task's rule on a batch of samples: each sample's reward, whether it is exactly right, and the named parts
    its reward is made of."""

    total: list[float]
    """Per sample: the reward (a reward-function task's weighted sum of its functions' values)."""
    exact: list[bool]
    """Per sample: whether the response is exactly right (:meth:`Task.exact`)."""
    parts: list[dict[str, float]]
    """Per sample: named values for the metrics (``reward/<name>``): each reward function's own (unweighted)
    value, and the other numbers of a verl function's dict as ``<function>/<key>``; empty for a built-in task."""

    def per_sample(self) -> list[tuple[float, bool, dict[str, float]]]:
        """``(total, exact, parts)`` of each sample: a batch column, which moves with its rows."""
        return list(zip(self.total, self.exact, self.parts))

    @classmethod
    def of_samples(cls, samples: Sequence[tuple[float, bool, dict[str, float]]]) -> BatchScores:
        """The scores of a :meth:`per_sample` column (of any rows, in any order)."""
        return cls([s[0] for s in samples], [s[1] for s in samples], [s[2] for s in samples])


class Task(ABC):
    """A prompt distribution with a scoring rule. Subclasses are frozen dataclasses of their options."""

    name: ClassVar[str]
    answer_chars: ClassVar[str] = string.digits + string.ascii_lowercase
    """Characters a correct answer is made of (used to build plausible wrong answers)."""

    @abstractmethod
    def sample(self, rng: random.Random) -> Example:
        """Draw one example; all randomness comes from ``rng``."""

    @abstractmethod
    def solve(self, prompt: str) -> str:
        """The correct answer to a prompt of this task."""

    def score(self, prompt: str, response: str, answer: str | None) -> float:
        """Reward in [0, 1] with partial credit; 1.0 exactly when the response is correct."""
        return partial_credit(response, answer if answer is not None else self.solve(prompt))

    def exact(self, prompt: str, response: str, answer: str | None) -> bool:
        """Whether the response is exactly correct (the success rate counts these)."""
        return self.score(prompt, response, answer) >= EXACT_SCORE

    def score_batch(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        answers: Sequence[str | None],
        rows: Sequence[Mapping[str, Any]],
    ) -> BatchScores:
        """The rule on a batch: ``score`` and ``exact`` of each sample (``rows``, the prompt file's other columns,
        serve tasks whose reward functions read them)."""
        samples = list(zip(prompts, responses, answers))
        return BatchScores([self.score(*s) for s in samples], [self.exact(*s) for s in samples], [{} for _ in samples])

    def demonstration(self, example: Example) -> str:
        """The target response for supervised fine-tuning: the answer (eos is added by the caller)."""
        return example.answer if example.answer is not None else self.solve(example.prompt)

    def _operand(self, prompt: str, keyword: str) -> str:
        """The text between '<keyword> ' and the final '='; a malformed prompt is a data error."""
        head = f"{keyword} "
        if not (prompt.startswith(head) and prompt.endswith("=")):
            raise DataError(f"task '{self.name}': prompt {prompt!r} is not of the form '{head}...='")
        return prompt[len(head) : -1]


def _check_range(task: str, low_name: str, low: int, high_name: str, high: int, floor: int) -> None:
    if not floor <= low <= high:
        raise DataError(
            f"task '{task}': {low_name}={low}, {high_name}={high} (need {floor} <= {low_name} <= {high_name})"
        )


@dataclass(frozen=True)
class SortDigits(Task):
    """Sort a string of digits ascending: 'sort 31415=' → '11345'."""

    min_len: int = 3
    """Fewest digits in a prompt."""
    max_len: int = 6
    """Most digits in a prompt."""

    name: ClassVar[str] = "sort"
    answer_chars: ClassVar[str] = string.digits

    def __post_init__(self) -> None:
        _check_range(self.name, "min_len", self.min_len, "max_len", self.max_len, floor=1)

    def sample(self, rng: random.Random) -> Example:
        n = rng.randint(self.min_len, self.max_len)
        digits = "".join(rng.choice(string.digits) for _ in range(n))
        return Example(prompt=f"sort {digits}=", answer="".join(sorted(digits)))

    def solve(self, prompt: str) -> str:
        return "".join(sorted(self._operand(prompt, "sort")))


@dataclass(frozen=True)
class AddNumbers(Task):
    """Add two non-negative integers: 'add 12+345=' → '357'."""

    max_digits: int = 3
    """Most digits per operand; each operand's digit count is uniform in 1..max_digits."""

    name: ClassVar[str] = "add"
    answer_chars: ClassVar[str] = string.digits

    def __post_init__(self) -> None:
        if self.max_digits < 1:
            raise DataError(f"task 'add': max_digits={self.max_digits} (need max_digits >= 1)")

    def _operand_value(self, rng: random.Random) -> int:
        # Uniform digit count first, so short numbers are as common as long ones.
        digits = rng.randint(1, self.max_digits)
        return rng.randrange(0 if digits == 1 else 10 ** (digits - 1), 10**digits)

    def sample(self, rng: random.Random) -> Example:
        a, b = self._operand_value(rng), self._operand_value(rng)
        return Example(prompt=f"add {a}+{b}=", answer=str(a + b))

    def solve(self, prompt: str) -> str:
        left, plus, right = self._operand(prompt, "add").partition("+")
        if not (plus and left.isdigit() and right.isdigit()):
            raise DataError(f"task 'add': prompt {prompt!r} is not of the form 'add <int>+<int>='")
        return str(int(left) + int(right))


@dataclass(frozen=True)
class ReverseWord(Task):
    """Reverse a lowercase word: 'rev abcd=' → 'dcba'."""

    min_len: int = 3
    """Fewest letters in a word."""
    max_len: int = 7
    """Most letters in a word."""

    name: ClassVar[str] = "reverse"
    answer_chars: ClassVar[str] = string.ascii_lowercase

    def __post_init__(self) -> None:
        _check_range(self.name, "min_len", self.min_len, "max_len", self.max_len, floor=1)

    def sample(self, rng: random.Random) -> Example:
        n = rng.randint(self.min_len, self.max_len)
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(n))
        return Example(prompt=f"rev {word}=", answer=word[::-1])

    def solve(self, prompt: str) -> str:
        return self._operand(prompt, "rev")[::-1]


TASKS: dict[str, type[Task]] = {"sort": SortDigits, "add": AddNumbers, "reverse": ReverseWord}
"""Built-in task name → class."""


class EnvironmentScored(Task):
    """A prompt file without reward functions: its rows are scored by the run's environment (``rollout.env``),
    whose episodes carry their own rewards; asked for a score of its own, it says so in one line."""

    name: ClassVar[str] = "file"

    def sample(self, rng: random.Random) -> Example:
        raise DataError("task 'file': a prompt file's task has no prompt generator (its rows are the prompts)")

    def solve(self, prompt: str) -> str:
        raise DataError("task 'file': no reward functions; its rows are scored by the run's environment")

    def score(self, prompt: str, response: str, answer: str | None) -> float:
        raise DataError(
            "task 'file': no reward functions to score a response with (set task.reward_fn, or score by an "
            "environment: rollout.env.name)"
        )


def make_task(name: str, **options: Any) -> Task:
    """Build a built-in task by name; unknown names or options raise a one-line DataError."""
    if name not in TASKS:
        raise DataError(f"task '{name}': unknown (valid: {', '.join(TASKS)})")
    cls = TASKS[name]
    valid = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise DataError(f"task '{name}': unknown option '{unknown[0]}' (valid: {', '.join(valid)})")
    bad = {k: v for k, v in options.items() if not isinstance(v, int) or isinstance(v, bool)}
    if bad:
        key, value = next(iter(bad.items()))
        raise DataError(f"task '{name}': option {key}={value!r} must be an integer")
    return cls(**options)
