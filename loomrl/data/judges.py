"""Generative reward models (judges): the prompt a judge reads, how its verdict becomes a score, and a synthetic
task of verdicts to train a judge on.

A judge is a causal LM. For each sample it reads a prompt made from the sample's prompt, response and reference
answer by a template (``{prompt}``, ``{response}`` and ``{answer}`` in ``reward.judges[i].template``), writes a
verdict greedily, and the verdict is turned into a number by ``reward.judges[i].verdict``:

- ``yes-no``: 1.0 for a verdict that starts with "yes", 0.0 for one that starts with "no";
- ``regex:PATTERN``: the first group of the pattern's first match, as a number;
- ``module:function`` or ``file.py:function``: the function, given the verdict's text, returns the number.

A verdict that none of these reads scores 0.0 (``judge<i>/unreadable`` in the metrics counts them).

:class:`JudgeTask` (``task.name=judge``, judging ``task.judged``) makes the training data of such a judge: the
judged task's prompts with a response that is right half of the time and a plausible wrong one otherwise, and the
verdict "yes" or "no". ``loomrl sft task.name=judge`` trains a judge on it like any policy.
"""

from __future__ import annotations

import math
import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from loomrl.data.tasks import Example, Task
from loomrl.errors import DataError

__all__ = ["DEFAULT_TEMPLATE", "JudgeTask", "VerdictFn", "check_template", "judge_prompt", "verdict_reader"]

DEFAULT_TEMPLATE = "judge {prompt}{response}|{answer}:"
"""A judge's prompt for a built-in task: only characters of the task tokenizer's alphabet."""
FIELDS = ("prompt", "response", "answer")

VerdictFn = Callable[[str], "float | None"]
"""A verdict's text → its score, or None when the verdict cannot be read."""


def check_template(template: str) -> str | None:
    """Why ``template`` is not a judge template (a placeholder other than :data:`FIELDS`, broken braces), or
    None."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as err:
        return str(err)
    unknown = sorted(names - set(FIELDS))
    if unknown:
        return f"placeholder {{{unknown[0]}}} is not one of {{prompt}}, {{response}}, {{answer}}"
    return None


def judge_prompt(template: str, prompt: str, response: str, answer: str | None) -> str:
    return template.format(prompt=prompt, response=response, answer="" if answer is None else answer)


def _yes_no(text: str) -> float | None:
    text = text.strip().lower()
    if text.startswith("yes"):
        return 1.0
    if text.startswith("no"):
        return 0.0
    return None


def verdict_reader(spec: str) -> VerdictFn:
    """The reader named by a judge's ``verdict`` setting (module docstring); a user function is imported here and
    its failures and non-numbers become one-line errors naming it."""
    if spec == "yes-no":
        return _yes_no
    if spec.startswith("regex:"):
        pattern = re.compile(spec[len("regex:") :])

        def read(text: str) -> float | None:
            found = pattern.search(text)
            if found is None:
                return None
            try:
                return float(found.group(1) if pattern.groups else found.group(0))
            except ValueError:
                return None

        return read
    from loomrl.data.reward_functions import load_reward_fn

    fn = load_reward_fn(spec)

    def called(text: str) -> float | None:
        try:
            value = fn(text)
        except Exception as exc:  # noqa: BLE001 - user code: any failure is reported in one line
            raise DataError(
                f"verdict reader '{spec}' raised {type(exc).__name__}: {exc} (verdict {text[:60]!r})"
            ) from None
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DataError(
                f"verdict reader '{spec}' returned {value!r} for verdict {text[:60]!r}; it must return "
                "a finite number or None"
            )
        return float(value)

    return called


def check_verdict(spec: str) -> str | None:
    """Why ``spec`` names no verdict reader (without importing a user function), or None."""
    if spec == "yes-no":
        return None
    if spec.startswith("regex:"):
        try:
            re.compile(spec[len("regex:") :])
        except re.error as err:
            return f"the pattern does not compile ({err})"
        return None
    module, colon, function = spec.rpartition(":")
    if colon and module and function:
        return None
    return "is none of 'yes-no', 'regex:PATTERN', 'module:function' or 'file.py:function'"


@dataclass(frozen=True)
class JudgeTask(Task):
    """Verdicts on another task's responses: 'judge sort 31=13|13:' → 'yes' (module docstring)."""

    judged: Task
    """The task whose responses are judged."""
    template: str = DEFAULT_TEMPLATE

    name: ClassVar[str] = "judge"
    answer_chars: ClassVar[str] = string.ascii_lowercase

    def sample(self, rng: random.Random) -> Example:
        base = self.judged.sample(rng)
        answer = base.answer if base.answer is not None else self.judged.solve(base.prompt)
        right = rng.random() < 0.5
        response = answer if right else wrong_answer(answer, self.judged.answer_chars, rng)
        return Example(judge_prompt(self.template, base.prompt, response, answer), "yes" if right else "no")

    def solve(self, prompt: str) -> str:
        raise DataError("task 'judge': an example needs its verdict (answer); it is not computed from the prompt")


WRONG_KINDS = (0, 0, 0, 1, 1, 1, 2, 3, 4, 5, 5, 6)
"""How often each kind of wrong response is drawn (:func:`wrong_answer`): mostly of the answer's length (a changed
or swapped character), so that a judge cannot tell right from wrong by length alone, and cut short, as a policy's
near misses are (a judge never shown short answers learned to call them right, and GRPO found that out)."""


def wrong_answer(answer: str, chars: str, rng: random.Random) -> str:
    """A plausible wrong response, never ``answer`` itself: by kind (:data:`WRONG_KINDS`), 0 one character
    changed, 1 two swapped, 2 one dropped, 3 one added, 4 another string of the same characters, 5 the answer cut
    short (down to nothing), 6 the answer with more after it."""
    for _ in range(100):
        kind = rng.choice(WRONG_KINDS)
        s = list(answer)
        if kind == 0 and s:
            s[rng.randrange(len(s))] = rng.choice(chars)
        elif kind == 1 and len(s) > 1:
            i, j = rng.sample(range(len(s)), 2)
            s[i], s[j] = s[j], s[i]
        elif kind == 2 and s:
            del s[rng.randrange(len(s))]
        elif kind == 3:
            s.insert(rng.randrange(len(s) + 1), rng.choice(chars))
        elif kind == 4:
            s = [rng.choice(chars) for _ in range(rng.randint(1, max(1, len(answer) + 1)))]
        elif kind == 5:
            s = s[: rng.randrange(len(s))] if s else s
        else:
            s = s + [rng.choice(chars) for _ in range(rng.randint(1, 3))]
        if "".join(s) != answer:
            return "".join(s)
    return answer + chars[0]
