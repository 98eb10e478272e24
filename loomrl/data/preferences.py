"""Synthetic preference pairs for Bradley–Terry reward-model training.

Each pair is (prompt, chosen, rejected) where ``task.score(prompt, chosen) > task.score(prompt, rejected)``
strictly, so the ranking rule a reward model has to learn is the task's own partial-credit score.

Candidates are the reference answer corrupted in graded ways: k substituted characters, a shuffle of its
characters, a truncation, an extension, or a random string (possibly empty). Even-indexed pairs put the
correct answer against one corruption (mostly easy); odd-indexed pairs compare two corruptions (often hard:
both wrong, differing by a character or two). Pair i depends only on (seed, i).
"""

from __future__ import annotations

import random

from loomrl.data.prompts import stable_hash
from loomrl.data.tasks import Task

_MAX_TRIES = 100


def _substitute(answer: str, chars: str, rng: random.Random) -> str:
    """Replace 1..len characters, each by a different character."""
    out = list(answer)
    for i in rng.sample(range(len(out)), rng.randint(1, len(out))):
        out[i] = rng.choice([c for c in chars if c != out[i]])
    return "".join(out)


def _shuffle(answer: str, chars: str, rng: random.Random) -> str:
    """The right characters in a random order (for sort: the right digits, unsorted)."""
    return "".join(rng.sample(answer, len(answer)))


def _truncate(answer: str, chars: str, rng: random.Random) -> str:
    return answer[: rng.randrange(len(answer))]


def _extend(answer: str, chars: str, rng: random.Random) -> str:
    return answer + "".join(rng.choice(chars) for _ in range(rng.randint(1, 3)))


def _random_string(answer: str, chars: str, rng: random.Random) -> str:
    return "".join(rng.choice(chars) for _ in range(rng.randint(0, len(answer) + 2)))


_CORRUPTIONS = (_substitute, _substitute, _shuffle, _truncate, _extend, _random_string)
"""Substitution is listed twice: near-misses are the most informative negatives."""


def _corrupt(answer: str, chars: str, rng: random.Random) -> str:
    """A response different from ``answer``."""
    for _ in range(_MAX_TRIES):
        candidate = rng.choice(_CORRUPTIONS)(answer, chars, rng)
        if candidate != answer:
            return candidate
    return answer + chars[0]  # only reachable for degenerate answers such as a single repeated character


def _pair(task: Task, rng: random.Random, against_correct: bool) -> tuple[str, str, str]:
    example = task.sample(rng)
    answer = task.demonstration(example)
    chars = task.answer_chars

    def score(response: str) -> float:
        return task.score(example.prompt, response, example.answer)

    if not against_correct:
        for _ in range(_MAX_TRIES):
            a, b = _corrupt(answer, chars, rng), _corrupt(answer, chars, rng)
            if score(a) != score(b):
                chosen, rejected = (a, b) if score(a) > score(b) else (b, a)
                return example.prompt, chosen, rejected
    # The correct answer scores 1.0 and any corruption less, so this pair is always strictly ordered.
    return example.prompt, answer, _corrupt(answer, chars, rng)


def preference_pairs(task: Task, n: int, seed: int) -> list[tuple[str, str, str]]:
    """``n`` (prompt, chosen, rejected) triples with task.score(chosen) > task.score(rejected).

    Half the pairs (even indices) have the correct answer as chosen. The task must be able to sample
    prompts (a built-in task, not a FunctionTask).
    """
    return [
        _pair(task, random.Random(stable_hash(seed, "preferences", i)), against_correct=i % 2 == 0) for i in range(n)
    ]
