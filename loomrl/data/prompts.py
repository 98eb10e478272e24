"""Prompt sources addressed by integer index, so a resumed run continues at the same data position.

A :class:`PromptSource` maps index i to an :class:`Example` with no hidden iterator state: the trainer
stores "next index" in its checkpoint and asks for ``batch(start, n)``.

- :class:`SyntheticPrompts` draws example i of a task from a generator seeded by a stable 64-bit hash of
  (seed, split, i). Splits are independent streams, but a task with a small prompt space (3-digit sort has
  1000 prompts) will have eval prompts that also occur in train: the eval split measures the policy on
  fresh draws from the task distribution, not on held-out prompts.
- :class:`FilePrompts` reads a JSONL or parquet file with HF ``datasets`` (local files only): a text prompt or
  a chat conversation per row.

:func:`load_reward_fn` and :class:`FunctionTask` let file prompts be scored by user reward functions, in loomrl's,
TRL's or verl's form (:mod:`loomrl.data.reward_forms`), each in a process of its own with every call under a time
limit (:mod:`loomrl.data.reward_functions`).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from loomrl.data.reward_forms import RewardFunction
from loomrl.data.reward_functions import RewardFn, RewardProcess
from loomrl.data.tasks import EXACT_SCORE, BatchScores, Example, Task
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
    None. Pass ``answer_key=None`` to ignore answers. Every column but the prompt's is kept, as read, in the
    example's ``row``, for reward functions that ask for them by name.
    """

    def __init__(
        self, path: str | os.PathLike[str], prompt_key: str = "prompt", answer_key: str | None = "answer"
    ) -> None:
        self.path = os.fspath(path)
        columns = _load_columns(self.path)
        if prompt_key not in columns:
            chat = " (a chat column: set task.prompt_key=messages)" if "messages" in columns else ""
            raise DataError(
                f"prompt file '{self.path}': no column '{prompt_key}' (columns present: {', '.join(columns)}){chat}"
            )
        prompts = columns[prompt_key]
        if not prompts:
            raise DataError(f"prompt file '{self.path}': has no rows")
        answers = columns[answer_key] if answer_key in columns else [None] * len(prompts)
        others = [name for name in columns if name != prompt_key]
        self.examples = [
            self._example(i, p, a, prompt_key, {name: columns[name][i] for name in others})
            for i, (p, a) in enumerate(zip(prompts, answers))
        ]

    def _example(self, row: int, prompt: Any, answer: Any, key: str, others: dict[str, Any]) -> Example:
        answer = None if answer is None else str(answer)
        if isinstance(prompt, str):
            return Example(prompt, answer, row=others)
        turns = _turns(prompt)
        if turns is None:
            raise DataError(
                f"prompt file '{self.path}': row {row} of column '{key}' holds {prompt!r}, neither a "
                "string nor a list of {'role', 'content'} messages"
            )
        if turns and turns[-1][0] == "assistant" and len(turns) > 1:
            answer = turns[-1][1] if answer is None else answer
            turns = turns[:-1]
        if not turns:
            raise DataError(f"prompt file '{self.path}': row {row} of column '{key}' is an empty conversation")
        text = next((content for role, content in reversed(turns) if role == "user"), turns[-1][1])
        return Example(text, answer, tuple(turns), others)

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
        if not (
            isinstance(message, Mapping)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            return None
        turns.append((message["role"], message["content"]))
    return turns


def _load_columns(path: str) -> dict[str, list]:
    """All columns of a local JSONL/parquet file, loaded with HF ``datasets`` (without its progress bars: an error
    is one line); a file it cannot read is looked at again to say where it is malformed."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in _FILE_FORMATS:
        raise DataError(f"prompt file '{path}': unsupported extension '{suffix}' (valid: {', '.join(_FILE_FORMATS)})")
    if not os.path.isfile(path):
        raise DataError(f"prompt file '{path}': does not exist")
    import datasets  # deferred: importing datasets costs ~1 s and only file sources need it
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    quiet = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        ds = datasets.load_dataset(_FILE_FORMATS[suffix], data_files=path, split="train")
        return ds.to_dict()  # here, where text that is not UTF-8 fails (the JSON reader passes it through)
    except Exception as exc:  # noqa: BLE001 — datasets raises many types for a malformed file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        reason = (_json_problem(path) if suffix != ".parquet" else None) or first
        raise DataError(f"prompt file '{path}': cannot be read ({reason})") from exc
    finally:
        if not quiet:
            enable_progress_bars()


def _json_problem(path: str) -> str | None:
    """Where a JSON or JSONL prompt file that ``datasets`` could not read is malformed, in words; None when this
    finds nothing wrong."""
    data = open(path, "rb").read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        return f"not UTF-8 text: byte {err.start} on line {line}"
    if not text.strip():
        return 'the file is empty; a prompt file holds one JSON object per line, e.g. {"prompt": "..."}'
    try:
        whole = json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError:
        return "nested too deeply"
    except ValueError:
        whole = None  # JSON lines, read line by line below
    else:
        rows = whole if isinstance(whole, list) else [whole]
        if not rows:
            return "an empty list: no rows"
        bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
        return None if bad is None else f'row {bad} is {_short_json(rows[bad])}, not an object {{"prompt": ...}}'
    for number, line in enumerate(text.split("\n"), 1):  # JSON strings may hold other line breaks
        if not line.strip():
            continue
        try:
            row = json.loads(line, object_pairs_hook=_unique_keys)
        except RecursionError:
            return f"line {number}: nested too deeply"
        except ValueError as err:
            return f"line {number}: {getattr(err, 'msg', err)}"
        if not isinstance(row, dict):
            return f'line {number}: {_short_json(row)} is not an object {{"prompt": ...}}'
    return None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    twice = next((key for key in keys if keys.count(key) > 1), None)
    if twice is not None:
        raise ValueError(f"key {twice!r} appears twice in one object")
    return dict(pairs)


def _short_json(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


class FunctionTask(Task):
    """A task whose score is one user reward function, or the weighted sum of several, for prompts from a file; it
    cannot sample prompts itself.

    Each function may take any of the forms of :mod:`loomrl.data.reward_forms` (loomrl's per sample, TRL's batched,
    verl's ``compute_score``), read from its signature. With ``timeout_s`` > 0 each runs in a process of its own
    (:class:`~loomrl.data.reward_functions.RewardProcess`), each call limited to that many seconds; 0 calls them
    here, without a limit. Either way a call that raises, hangs past the limit or returns something other than a
    finite number raises a one-line :class:`DataError` naming the function and the sample. The functions are
    also imported here, so a wrong name or signature fails before any call.
    """

    def __init__(
        self,
        fn: RewardFn | str | Sequence[RewardFn | str],
        name: str = "function",
        timeout_s: float = 0.0,
        weights: Sequence[float] | None = None,
    ) -> None:
        fns = [fn] if isinstance(fn, str) or callable(fn) else list(fn)
        weights = [1.0] * len(fns) if weights is None else [float(w) for w in weights]
        if not fns or len(weights) != len(fns):
            raise DataError(
                f"reward functions: {len(fns)} given with {len(weights)} weights (give at least one "
                "function, and one weight per function)"
            )
        self.functions = [RewardFunction(f, timeout_s) for f in fns]
        self.weights = weights
        self.labels = _labels([f.name for f in self.functions])
        """Per function: its name in the metrics (``reward/<label>``)."""
        self.spec = ", ".join(f.spec for f in self.functions)
        self.name = name  # type: ignore[misc]  # an instance attribute shadows Task's ClassVar on purpose
        self.timeout_s = timeout_s

    @property
    def process(self) -> RewardProcess | None:
        """The (first) function's process; None when the functions run here."""
        return self.functions[0].process

    def sample(self, rng: random.Random) -> Example:
        raise DataError(f"task '{self.name}': a reward-function task has no prompt generator (use FilePrompts)")

    def solve(self, prompt: str) -> str:
        raise DataError(f"task '{self.name}': no reference answer for prompt {prompt!r} (add an answer column)")

    def score(self, prompt: str, response: str, answer: str | None) -> float:
        """The reward of one sample (without the row's other columns: :meth:`score_batch` passes those)."""
        return self.score_batch([prompt], [response], [answer], [{}]).total[0]

    def score_batch(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        answers: Sequence[str | None],
        rows: Sequence[Mapping[str, Any]],
    ) -> BatchScores:
        """Each function on the batch; a sample's reward is their weighted sum, its parts their own values."""
        total = [0.0] * len(prompts)
        parts: list[dict[str, float]] = [{} for _ in prompts]
        for fn, weight, label in zip(self.functions, self.weights, self.labels):
            rewards = fn(prompts, responses, answers, rows, self.name)
            for i, (value, extras) in enumerate(zip(rewards.values, rewards.extras)):
                total[i] += weight * value
                parts[i][label] = value
                parts[i].update({f"{label}/{key}": v for key, v in extras.items()})
        return BatchScores(total, [t >= EXACT_SCORE for t in total], parts)  # as Task.exact, without calling again

    def close(self) -> None:
        """End the functions' processes, if they have them (a later call starts others)."""
        for fn in self.functions:
            fn.close()

    def __repr__(self) -> str:
        return f"FunctionTask({self.spec!r})"


_TAKEN = ("mean", "exact_match", "overlong_penalty")
"""Names under ``reward/`` that the rollout metrics give their own values (:mod:`loomrl.algorithms.metrics`)."""


def _labels(names: Sequence[str]) -> list[str]:
    """The functions' names, each made unique by its position in the list where it repeats or is taken."""
    return [f"{n}_{i}" if names.count(n) > 1 or n in _TAKEN else n for i, n in enumerate(names)]
