"""Prompt sources addressed by integer index, so a resumed run continues at the same data position.

A :class:`PromptSource` maps index i to an :class:`Example` with no hidden iterator state: the trainer
stores "next index" in its checkpoint and asks for ``batch(start, n)``.

- :class:`SyntheticPrompts` draws example i of a task from a generator seeded by a stable 64-bit hash of
  (seed, split, i). Splits are independent streams, but a task with a small prompt space (3-digit sort has
  1000 prompts) will have eval prompts that also occur in train: the eval split measures the policy on
  fresh draws from the task distribution, not on held-out prompts.
- :class:`FilePrompts` reads a JSONL or parquet file with HF ``datasets`` (local files only): a text prompt or
  a chat conversation per row.

:func:`load_reward_fn` and :class:`FunctionTask` let file prompts be scored by a user function (in a process
of its own, each call under a time limit: :mod:`loomrl.data.reward_functions`).
"""

from __future__ import annotations

import hashlib
import json
import numbers
import os
import random
import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from loomrl.data.reward_functions import RewardFn, RewardProcess, describe_sample, load_reward_fn, one_line
from loomrl.data.tasks import Example, Task
from loomrl.errors import DataError

SPLITS = ("train", "eval", "test")
"""Names of the independent streams of a synthetic source."""

_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}

def stable_hash(*parts: int | str) -> int:
    """A 64-bit hash of ints and strings that is the same in every process (unlike the salted ``hash``)."""
    # JSON keeps ("a", 1) and ("a1",) apart, which plain concatenation would not.
    data = json.dumps(list(parts), separators=(",", ":")).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class PromptSource(ABC):
    """A finite or effectively infinite sequence of examples, addressed by index."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def _get(self, i: int) -> Example:
        """Example i, for 0 <= i < len(self)."""

    def __getitem__(self, i: int) -> Example:
        # IndexError past the end keeps the sequence protocol (iteration, list()) terminating.
        if not 0 <= i < len(self):
            raise IndexError(f"prompt index {i} out of range [0, {len(self)})")
        return self._get(i)

    def batch(self, start: int, n: int) -> list[Example]:
        """Examples start .. start+n-1; indices wrap modulo len, so passes over a file repeat in order."""
        if start < 0 or n < 0:
            raise ValueError(f"batch(start={start}, n={n}): both must be >= 0")
        size = len(self)
        return [self._get((start + k) % size) for k in range(n)]


class SyntheticPrompts(PromptSource):
    """Example i of ``split`` is ``task.sample(Random(stable_hash(seed, split, i)))``."""

    def __init__(self, task: Task, seed: int, split: str = "train") -> None:
        if split not in SPLITS:
            raise DataError(f"prompt split '{split}': unknown (valid: {', '.join(SPLITS)})")
        self.task, self.seed, self.split = task, seed, split

    def __len__(self) -> int:
        return sys.maxsize  # the largest length Python's len() accepts; effectively unbounded

    def _get(self, i: int) -> Example:
        return self.task.sample(random.Random(stable_hash(self.seed, self.split, i)))

    def __repr__(self) -> str:
        return f"SyntheticPrompts(task={self.task!r}, seed={self.seed}, split={self.split!r})"


class FilePrompts(PromptSource):
    """Prompts (and optional answers) from a local .jsonl/.json/.parquet file, in file order.

    A prompt is text, or a conversation so far: a list of ``{"role", "content"}`` messages (a chat dataset's
    ``messages`` column). A conversation that ends with an assistant turn (a complete chat demonstration) is
    split: the turns before it are the prompt, and its content is the answer when the row has none. Non-string
    answers (e.g. JSON numbers) are converted with ``str``; nulls, and a file without the answer column, give
    None. Pass ``answer_key=None`` to ignore answers.
    """

    def __init__(self, path: str | os.PathLike[str], prompt_key: str = "prompt",
                 answer_key: str | None = "answer") -> None:
        self.path = os.fspath(path)
        columns = _load_columns(self.path)
        if prompt_key not in columns:
            chat = " (a chat column: set task.prompt_key=messages)" if "messages" in columns else ""
            raise DataError(f"prompt file '{self.path}': no column '{prompt_key}' "
                            f"(columns present: {', '.join(columns)}){chat}")
        prompts = columns[prompt_key]
        if not prompts:
            raise DataError(f"prompt file '{self.path}': has no rows")
        answers = columns[answer_key] if answer_key in columns else [None] * len(prompts)
        self.examples = [self._example(i, p, a, prompt_key) for i, (p, a) in enumerate(zip(prompts, answers))]

    def _example(self, row: int, prompt: Any, answer: Any, key: str) -> Example:
        answer = None if answer is None else str(answer)
        if isinstance(prompt, str):
            return Example(prompt, answer)
        turns = _turns(prompt)
        if turns is None:
            raise DataError(f"prompt file '{self.path}': row {row} of column '{key}' holds {prompt!r}, neither a "
                            "string nor a list of {'role', 'content'} messages")
        if turns and turns[-1][0] == "assistant" and len(turns) > 1:
            answer = turns[-1][1] if answer is None else answer
            turns = turns[:-1]
        if not turns:
            raise DataError(f"prompt file '{self.path}': row {row} of column '{key}' is an empty conversation")
        text = next((content for role, content in reversed(turns) if role == "user"), turns[-1][1])
        return Example(text, answer, tuple(turns))

    def __len__(self) -> int:
        return len(self.examples)

    def _get(self, i: int) -> Example:
        return self.examples[i]

    def __repr__(self) -> str:
        return f"FilePrompts({self.path!r}, {len(self)} rows)"


def _turns(value: Any) -> list[tuple[str, str]] | None:
    """(role, content) pairs of a list of chat messages, or None when ``value`` is not one."""
    if not isinstance(value, (list, tuple)):
        return None
    turns = []
    for message in value:
        if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            return None
        turns.append((message["role"], message["content"]))
    return turns


def _load_columns(path: str) -> dict[str, list]:
    """All columns of a local JSONL/parquet file, loaded with HF ``datasets``."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in _FILE_FORMATS:
        raise DataError(f"prompt file '{path}': unsupported extension '{suffix}' "
                        f"(valid: {', '.join(_FILE_FORMATS)})")
    if not os.path.isfile(path):
        raise DataError(f"prompt file '{path}': does not exist")
    import datasets  # deferred: importing datasets costs ~1 s and only file sources need it

    try:
        ds = datasets.load_dataset(_FILE_FORMATS[suffix], data_files=path, split="train")
    except Exception as exc:  # noqa: BLE001 — datasets raises many types for a malformed file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataError(f"prompt file '{path}': cannot be read ({first})") from exc
    return {name: ds[name] for name in ds.column_names}


class FunctionTask(Task):
    """A task whose score is a user function, for prompts from a file; it cannot sample prompts itself.

    With ``timeout_s`` > 0 the function runs in a process of its own (:class:`~loomrl.data.reward_functions.
    RewardProcess`), each call limited to that many seconds; 0 calls it here, without a limit. Either way a
    call that raises, hangs past the limit or returns something other than a number in [0, 1] raises a one-line
    :class:`DataError` naming the function and the sample. The function is also imported here, so a wrong name
    fails before any call.
    """

    def __init__(self, fn: RewardFn | str, name: str = "function", timeout_s: float = 0.0) -> None:
        self.spec = fn if isinstance(fn, str) else getattr(fn, "__qualname__", repr(fn))
        self.fn = load_reward_fn(fn) if isinstance(fn, str) else fn
        self.name = name  # type: ignore[misc]  # an instance attribute shadows Task's ClassVar on purpose
        self.timeout_s = timeout_s
        self.process: RewardProcess | None = None
        if timeout_s > 0:
            target = fn if isinstance(fn, str) else f"{fn.__module__}:{fn.__qualname__}"
            if not isinstance(fn, str) and "<" in fn.__qualname__:
                raise DataError(f"reward function '{self.spec}': a time limit runs it in its own process, which "
                                "imports it by name: give a module-level function (or timeout_s=0)")
            self.process = RewardProcess(target, timeout_s)

    def sample(self, rng: random.Random) -> Example:
        raise DataError(f"task '{self.name}': a reward-function task has no prompt generator (use FilePrompts)")

    def solve(self, prompt: str) -> str:
        raise DataError(f"task '{self.name}': no reference answer for prompt {prompt!r} (add an answer column)")

    def score(self, prompt: str, response: str, answer: str | None) -> float:
        if self.process is not None:
            value = self.process(prompt, response, answer)
        else:
            try:
                value = self.fn(prompt, response, answer)
            except Exception as exc:  # noqa: BLE001 - user code: any failure stops the run with one line
                raise DataError(f"reward function '{self.spec}': raised {one_line(exc)} "
                                f"{describe_sample(prompt, response)}") from exc
        # A reward outside [0, 1] would silently change the scale every advantage is computed on;
        # the chained comparison is also False for NaN.
        if not (isinstance(value, numbers.Real) and 0.0 <= float(value) <= 1.0):
            raise DataError(f"reward function '{self.spec}': returned {value!r} for prompt {prompt!r} "
                            "(must be a number in [0, 1])")
        return float(value)

    def close(self) -> None:
        """End the function's process, if it has one (a later call starts another)."""
        if self.process is not None:
            self.process.close()

    def __repr__(self) -> str:
        return f"FunctionTask({self.spec!r})"
