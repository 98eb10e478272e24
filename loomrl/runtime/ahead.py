"""What a controller keeps of an asynchronous plan's generation ahead: batches generated before their iteration
(:class:`Pending`) and, under partial rollouts, the samples paused to continue in the next generate call
(:class:`InFlight`). Rows stay in the object store; the controller holds where they are and plain metadata.

Under partial rollouts (:class:`~loomrl.plan.plan.AsyncTraining`) a rollout generate call runs over the new
prompts and every paused sample (``Controller._with_in_flight``); its workers publish only the rows that finished, each
with the policy version of every token, and return the paused ones' tokens as plain data (:func:`split_call`),
so each sample's final columns live in exactly one output shard.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loomrl.algorithms.context import Resumed

Shards = dict[str, list[tuple[tuple[int, ...], Any]]]
"""Column → the (sample ids, object reference) of each output shard holding it."""

VERSIONS = "token_version"
"""A batch generated ahead, in a checkpoint: the column of the policy version that sampled each token of a row."""

IN_FLIGHT = "in_flight"
"""The key of a checkpoint's batches generated ahead that holds a partial rollout's paused samples."""


@dataclass
class Pending:
    """The rows generated ahead for one iteration (all of them, or under partial rollouts those finished so far),
    kept by the controller of their shard."""

    where: Shards
    """The output shards of the generate calls' columns."""
    tokens: dict[int, int]
    """Sample id → its token count (its response's)."""
    versions: dict[int, tuple[int, ...]]
    """Sample id → the policy version that sampled each of its tokens."""

    def add(self, other: Pending) -> None:
        for key, entries in other.where.items():
            self.where.setdefault(key, []).extend(entries)
        self.tokens.update(other.tokens)
        self.versions.update(other.versions)

    def token_versions(self) -> list[int]:
        return [v for row in self.versions.values() for v in row]

    def oldest(self, default: int) -> int:
        return min(self.token_versions(), default=default)


@dataclass
class InFlight:
    """Samples a partial rollout paused: where their input columns are, and what each generated so far."""

    where: Shards = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    """Sample id → its prompt's length (what weighs it when a generate call's rows are balanced)."""
    resumed: dict[int, Resumed] = field(default_factory=dict)

    @property
    def ids(self) -> list[int]:
        return list(self.resumed)


def select_where(where: Shards, keys: Sequence[str], ids: Sequence[int]) -> Shards:
    """The entries of ``keys`` restricted to ``ids`` (entries holding none of them dropped)."""
    wanted, out = set(ids), {}
    for key in keys:
        entries = [(tuple(s for s in held if s in wanted), ref) for held, ref in where.get(key, ())]
        out[key] = [(held, ref) for held, ref in entries if held]
    return out


def split_call(
    metas: Mapping[int, dict], owner: Mapping[int, int], inputs: Sequence[str], state: Any, keys: Sequence[str]
) -> tuple[InFlight | None, dict[int, Pending]]:
    """A partial rollout generate call's replies (device → meta) split into the samples it paused (their input
    columns' shards and token counts from the call's ``state``, a controller's iteration state) and, per
    iteration (``owner``: sample id → the iteration that trains it), the rows it finished, whose ``keys`` columns
    are in the published shards."""
    paused: dict[int, Resumed] = {}
    done: dict[int, Pending] = {}
    for meta in metas.values():
        paused.update({int(s): Resumed.of_plain(r) for s, r in meta.get("paused", {}).items()})
        if "shard" not in meta:
            continue
        ref, rows = meta["shard"][0], tuple(int(s) for s in meta["rows"])
        for it in sorted({owner[s] for s in rows}):
            mine = tuple(s for s in rows if owner[s] == it)
            piece = Pending(
                {k: [(mine, ref)] for k in keys},
                {s: int(meta["tokens"][s]) for s in mine},
                {s: tuple(meta["versions"][s]) for s in mine},
            )
            done.setdefault(it, Pending({}, {}, {})).add(piece)
    if not paused:
        return None, done
    tokens = {s: state.tokens[s] for s in paused}  # the paused rows' weights as the call had them: their prompts'
    return InFlight(select_where(state.where, inputs, list(paused)), tokens, paused), done


def generated_ahead(pending: Mapping[Any, tuple] | None) -> list[int]:
    """The iterations a checkpoint's batches generated ahead (the reference executor's form) hold samples of:
    finished, or paused to continue."""
    if not pending:
        return []
    iterations = {int(i) for i in pending if i != IN_FLIGHT}
    if IN_FLIGHT in pending:
        iterations |= {int(r[0]) for r in pending[IN_FLIGHT][2].values()}
    return sorted(iterations)
