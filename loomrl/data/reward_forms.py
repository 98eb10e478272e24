"""The three forms a user reward function may take, told apart by its signature (:func:`reward_form`), and
:class:`RewardFunction`, which calls a function of any form on a batch of samples and checks what it returns.

    loomrl   score(prompt, response, answer) -> float                one sample a call, arguments by position
    TRL      f(prompts, completions, **columns) -> list[float]        the whole batch in one call, by keyword
    verl     compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict
                                                                       one sample a call, by keyword

A function naming ``data_source``, ``solution_str`` and ``ground_truth`` is verl's; one naming ``completions`` is
TRL's; one that takes three positional arguments is loomrl's. TRL's form gets the prompt file's other columns by
name, as lists aligned with the batch: all of them with ``**kwargs``, else those it names (a required one that is
not a column is an error). verl's gets the row's ``data_source`` (else the task's name), its ground truth (the
answer, else a ``ground_truth`` column, else ``reward_model.ground_truth``, where verl's datasets keep it) and its
``extra_info`` dict ({} without one); a dict it returns must hold ``score``, and its other numbers are reported
too (:attr:`Rewards.extras`).

Any finite number is a reward, of either sign; NaN, inf or anything else (a string, a list of the wrong length)
stops the run with one line naming the function and the sample. With a time limit the function runs in a process
of its own (:class:`~loomrl.data.reward_functions.RewardProcess`), the limit applying to each call: one sample, or
one batch for TRL's form.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loomrl.data.reward_functions import (
    RewardFn,
    RewardProcess,
    describe_batch,
    describe_sample,
    load_reward_fn,
    one_line,
    plain,
)
from loomrl.errors import DataError

__all__ = ["FORMS", "Form", "RewardFunction", "Rewards", "reward_form"]

LOOMRL, TRL, VERL = "loomrl", "trl", "verl"
FORMS = {
    LOOMRL: "score(prompt, response, answer) -> float",
    TRL: "f(prompts, completions, **columns) -> list[float]",
    VERL: "compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict",
}
"""Each form's name and signature, as errors list them."""
_VERL_ARGS = ("data_source", "solution_str", "ground_truth")
_TRL_ARGS = ("prompts", "completions")
_SHOWN = 80
"""Characters of a wrong return value an error shows."""


@dataclass(frozen=True)
class Form:
    """How a reward function is called: its form and, for the keyword forms, which arguments it takes."""

    kind: str
    """loomrl, trl or verl (:data:`FORMS`)."""
    named: frozenset[str] = frozenset()
    """Arguments it takes by keyword."""
    required: tuple[str, ...] = ()
    """Those of ``named`` without a default."""
    any_keyword: bool = False
    """Whether it takes ``**kwargs``."""

    def takes(self, name: str) -> bool:
        return name in self.named or self.any_keyword


def reward_form(fn: RewardFn, spec: str) -> Form:
    """The form of ``fn`` (named ``spec`` in errors), from its parameters' names and kinds."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a readable signature: called by position, as always
        return Form(LOOMRL)
    params = list(signature.parameters.values())
    keyword = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    form = Form(
        "",
        frozenset(keyword),
        tuple(n for n, p in keyword.items() if p.default is p.empty),
        any(p.kind is p.VAR_KEYWORD for p in params),
    )
    by_keyword = not any(p.kind is p.POSITIONAL_ONLY and p.default is p.empty for p in params)
    if all(name in keyword for name in _VERL_ARGS):
        given = {*_VERL_ARGS, *(("extra_info",) if form.takes("extra_info") else ())}
        if by_keyword and set(form.required) <= given:
            return Form(VERL, form.named, form.required, form.any_keyword)
    elif "completions" in keyword:
        if by_keyword:
            return Form(TRL, form.named, form.required, form.any_keyword)
    else:
        try:
            signature.bind("prompt", "response", "answer")
            return Form(LOOMRL)
        except TypeError:
            pass
    name = getattr(fn, "__name__", spec)
    raise DataError(
        f"reward function '{spec}': its signature {name}{signature} fits none of the accepted forms: "
        + "; ".join(f"{kind}: {sig}" for kind, sig in FORMS.items())
    )


@dataclass(frozen=True)
class Rewards:
    """One function's rewards for a batch."""

    values: list[float]
    """Per sample: the function's reward."""
    extras: list[dict[str, float]]
    """Per sample: the other finite numbers of a verl function's dict, by key (empty for the other forms)."""


class RewardFunction:
    """One user reward function, imported by name ('module:function' or 'file.py:function') or given, its form
    read from its signature. With ``timeout_s`` > 0 it runs in a process of its own, each call limited to that
    many seconds; 0 calls it here, without a limit."""

    def __init__(self, fn: RewardFn | str, timeout_s: float = 0.0) -> None:
        self.spec = fn if isinstance(fn, str) else getattr(fn, "__qualname__", repr(fn))
        self.fn = load_reward_fn(fn) if isinstance(fn, str) else fn
        self.name = fn.rpartition(":")[2] if isinstance(fn, str) else getattr(fn, "__name__", self.spec)
        """What the metrics call it (``reward/<name>``): the name the spec gives it."""
        self.form = reward_form(self.fn, self.spec)
        self.process: RewardProcess | None = None
        if timeout_s > 0:
            if not isinstance(fn, str) and "<" in getattr(fn, "__qualname__", "<"):
                raise DataError(
                    f"reward function '{self.spec}': a time limit runs it in its own process, which "
                    "imports it by name: give a module-level function (or timeout_s=0)"
                )
            target = fn if isinstance(fn, str) else f"{fn.__module__}:{fn.__qualname__}"
            self.process = RewardProcess(target, timeout_s)

    def __call__(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        answers: Sequence[str | None],
        rows: Sequence[Mapping[str, Any]],
        source: str,
    ) -> Rewards:
        """The function's rewards for a batch; ``rows`` are the prompt file's other columns of each sample and
        ``source`` the data source of rows without one (verl's form)."""
        if not prompts:
            return Rewards([], [])
        if self.form.kind == TRL:
            return Rewards(self._batched(prompts, responses, rows), [{} for _ in prompts])
        if self.form.kind == VERL:
            pairs = [self._verl(p, r, a, row, source) for p, r, a, row in zip(prompts, responses, answers, rows)]
            return Rewards([v for v, _ in pairs], [e for _, e in pairs])
        values = []
        for p, r, a in zip(prompts, responses, answers):
            sample = describe_sample(p, r)
            values.append(self._number(self._call([p, r, a], {}, sample), sample))
        return Rewards(values, [{} for _ in values])

    def close(self) -> None:
        """End the function's process, if it has one (a later call starts another)."""
        if self.process is not None:
            self.process.close()

    # ------------------------------------------------------------------------------------------ internals
    def _call(self, args: Sequence[Any], kwargs: Mapping[str, Any], sample: str) -> Any:
        if self.process is not None:
            return self.process.call(args, kwargs, sample)
        try:
            return plain(self.fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - user code: any failure stops the run with one line
            raise DataError(f"reward function '{self.spec}': raised {one_line(exc)} {sample}") from exc

    def _number(self, value: Any, sample: str) -> float:
        # Any sign and scale is a reward; NaN or inf would turn every advantage of the batch into NaN.
        if isinstance(value, float) and math.isfinite(value):
            return value
        raise DataError(f"reward function '{self.spec}': returned {_short(value)} (must be a finite number) {sample}")

    def _batched(
        self, prompts: Sequence[str], responses: Sequence[str], rows: Sequence[Mapping[str, Any]]
    ) -> list[float]:
        """TRL's form: one call for the batch, columns by name."""
        columns = _columns(rows)
        for name in self.form.required:
            if name not in _TRL_ARGS and name not in columns:
                raise DataError(
                    f"reward function '{self.spec}': its argument '{name}' is not a column of the prompt "
                    f"file (columns: {', '.join(columns) or 'none but the prompt'})"
                )
        kwargs = {name: values for name, values in columns.items() if self.form.takes(name)}
        clash = sorted(set(kwargs) & set(_TRL_ARGS))
        if clash:
            raise DataError(
                f"reward function '{self.spec}': the prompt file's column '{clash[0]}' has the name of "
                "an argument of TRL's form (rename the column)"
            )
        kwargs["completions"] = list(responses)
        if self.form.takes("prompts"):
            kwargs["prompts"] = list(prompts)
        batch = describe_batch(prompts, responses)
        value = self._call([], kwargs, batch)
        n = len(prompts)
        if not isinstance(value, list) or len(value) != n:
            got = f"a list of {len(value)}" if isinstance(value, list) else _short(value)
            raise DataError(
                f"reward function '{self.spec}': returned {got} for a batch of {n} samples (must be a "
                f"list of {n} finite numbers, one per completion) {batch}"
            )
        return [self._number(v, describe_sample(p, r)) for v, p, r in zip(value, prompts, responses)]

    def _verl(
        self, prompt: str, response: str, answer: str | None, row: Mapping[str, Any], source: str
    ) -> tuple[float, dict[str, float]]:
        """verl's form: one call for the sample, by keyword; a dict's other finite numbers are extras."""
        kwargs = {
            "data_source": row.get("data_source") if row.get("data_source") is not None else source,
            "solution_str": response,
            "ground_truth": _ground_truth(answer, row),
        }
        if self.form.takes("extra_info"):
            extra = row.get("extra_info")
            kwargs["extra_info"] = dict(extra) if isinstance(extra, Mapping) else {}
        sample = describe_sample(prompt, response)
        value = self._call([], kwargs, sample)
        if not isinstance(value, dict):
            return self._number(value, sample), {}
        if "score" not in value:
            raise DataError(
                f"reward function '{self.spec}': returned a dict without a 'score' key (keys: "
                f"{', '.join(value) or 'none'}) {sample}"
            )
        extras = {k: v for k, v in value.items() if k != "score" and isinstance(v, float) and math.isfinite(v)}
        return self._number(value["score"], sample), extras


def _columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """The rows' columns as lists aligned with the batch (a column a row lacks is None there)."""
    names = list(dict.fromkeys(name for row in rows for name in row))
    return {name: [row.get(name) for row in rows] for name in names}


def _ground_truth(answer: str | None, row: Mapping[str, Any]) -> Any:
    """The sample's answer, else its ground truth where verl's datasets keep it."""
    if answer is not None:
        return answer
    if row.get("ground_truth") is not None:
        return row["ground_truth"]
    model = row.get("reward_model")
    return model.get("ground_truth") if isinstance(model, Mapping) else None


def _short(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= _SHOWN else shown[: _SHOWN - 3] + "..."
