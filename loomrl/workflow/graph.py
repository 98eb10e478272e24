"""The workflow graph: an RLHF algorithm as a dataflow of model function calls (MFCs).

Each MFC names the model role it runs on (``actor``, ``critic``, ``ref``, ``reward``; none for a pure
``compute`` step), what kind of call it is, and the data keys it reads and writes. Edges are not written
by hand: an MFC depends on the unique MFC that produces each key it reads. :class:`Workflow` validates a
list of MFCs once, at construction, and answers the questions a planner and an executor ask: in which
order can the calls run, who consumes a key, and, unrolled over training iterations, which calls must
wait for a role's weights to be updated.

The graph only describes; it never calls an MFC's ``op``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum

from loomrl.errors import WorkflowError

LOSS_UNITS = ("token", "sequence")
REWARD_KEY = "score"
"""The key of each sample's reward (before shaping): what dynamic sampling's group filter reads."""
"""What one row counts for in a train call's mean loss: its real tokens (a token-mean) or one (a mean over
sequences); a train MFC's ``loss_unit`` (:func:`loomrl.workflow.minibatches.loss_weights`)."""

__all__ = ["LOSS_UNITS", "MFC", "MFCKind", "Workflow"]


class MFCKind(str, Enum):
    """What a model function call does to its model."""

    GENERATE = "generate"
    """Sample responses (autoregressive decoding)."""
    INFERENCE = "inference"
    """One forward pass without gradients (log-probs, values, scores)."""
    TRAIN = "train"
    """Forward, backward and optimiser step: the only kind that changes a model's weights."""
    COMPUTE = "compute"
    """A cheap pure function with no model, e.g. advantage estimation."""


@dataclass(frozen=True)
class MFC:
    """One model function call: ``op`` run on ``role``'s model, reading ``inputs`` and writing ``outputs``."""

    name: str
    """Unique name within the workflow, e.g. ``"actor_gen"``."""
    role: str | None
    """The model the call runs on; ``None`` for a ``compute`` step and only for it."""
    kind: MFCKind
    """What the call does to the model."""
    inputs: tuple[str, ...]
    """Data keys read: each a source key of the dataset or an output of exactly one other MFC."""
    outputs: tuple[str, ...]
    """Data keys written. A ``train`` call writes none: it returns statistics, merged into the metrics."""
    op: Callable | None = field(default=None, compare=False)
    """The function the executor calls; ignored by the graph and by equality and hashing."""
    stream: Callable | None = field(default=None, compare=False)
    """``generate`` calls: the op's streaming form for fused stages, ``stream(ctx, batch)`` yielding ``(sample
    ids, columns)`` of samples as they finish; ignored by the graph."""
    doc: str = ""
    """One line for documentation and plan printouts."""
    epochs: int = 1
    """``train`` only: passes over the batch."""
    minibatches: int = 1
    """``train`` only: optimizer steps per pass; the executor splits the batch (and each minibatch over the
    data-parallel ranks), so every executor takes the same steps on the same samples."""
    loss_unit: str = "token"
    """``train`` only: what each row weighs in its minibatch's mean loss, ``token`` (its response tokens) or
    ``sequence`` (one): the executor weights each rank's loss, and the op each micro-batch's, by their rows'
    share of it (:func:`~loomrl.workflow.minibatches.loss_weights`)."""
    max_new_tokens: int | None = None
    """``generate`` only: the call's own response budget (a judge's verdict); None: the run's responses, whose
    lengths the workload gives."""
    reads_response: bool = False
    """``generate`` only: its prompt holds the policy's response too (a judge reads prompt and response), so the
    planner prices its prefill over both."""
    multi_turn: bool = False
    """``generate`` only: episodes with an environment (``rollout.env``), whose responses hold observation tokens
    that are prefilled, not decoded, and whose turns wait on the environment; the planner prices them so
    (:attr:`~loomrl.planner.cost.workload.Workload.episodes`)."""

    def __post_init__(self) -> None:
        # Accept plain strings and lists from hand-written or config-built MFCs; store canonical types
        # so that MFCs hash and compare predictably.
        if not isinstance(self.name, str) or not self.name:
            raise WorkflowError(f"MFC name must be a non-empty string, got {self.name!r}")
        kind = _parse_kind(self.kind, self.name)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        if kind is MFCKind.COMPUTE and self.role is not None:
            raise WorkflowError(f"MFC {self.name!r}: a compute step has no role, got role {self.role!r}")
        if kind is not MFCKind.COMPUTE and not self.role:
            raise WorkflowError(f"MFC {self.name!r}: a {kind.value} call needs a role, e.g. 'actor'")
        if kind is not MFCKind.TRAIN and not self.outputs:
            raise WorkflowError(f"MFC {self.name!r}: a {kind.value} call must produce at least one key")
        for what, keys in (("input", self.inputs), ("output", self.outputs)):
            _check_keys(self.name, what, keys)
        if self.loss_unit not in LOSS_UNITS:
            raise WorkflowError(
                f"MFC {self.name!r}: unknown loss_unit {self.loss_unit!r}; valid: {', '.join(LOSS_UNITS)}"
            )

    @property
    def per_wave(self) -> bool:
        """Whether dynamic sampling runs the call on every wave of prompts: generation, and the call that makes
        the rewards its group filter reads (:data:`REWARD_KEY`)."""
        return self.kind is MFCKind.GENERATE or REWARD_KEY in self.outputs

    @property
    def model_role(self) -> str:
        """``role`` of a call on a model (every kind but ``compute``, which has none)."""
        if self.role is None:
            raise WorkflowError(f"MFC {self.name!r}: a compute step has no role")
        return self.role


def _parse_kind(kind: object, name: str) -> MFCKind:
    try:
        return MFCKind(kind)
    except ValueError:
        valid = ", ".join(k.value for k in MFCKind)
        raise WorkflowError(f"MFC {name!r}: unknown kind {kind!r}; valid: {valid}") from None


def _check_keys(name: str, what: str, keys: tuple[str, ...]) -> None:
    for key in keys:
        if not isinstance(key, str) or not key:
            raise WorkflowError(f"MFC {name!r}: {what} keys must be non-empty strings, got {key!r}")
    seen: set[str] = set()
    for key in keys:
        if key in seen:
            raise WorkflowError(f"MFC {name!r} lists {what} key {key!r} twice")
        seen.add(key)


"""``(iteration, mfc, dependencies)`` with each dependency an ``(iteration, mfc name)`` pair."""


class Workflow:
    """A validated graph of MFCs. Iterating yields MFCs in topological order."""

    def __init__(self, mfcs: Sequence[MFC], source_keys: Iterable[str]) -> None:
        self._given: tuple[MFC, ...] = tuple(mfcs)
        self._source_keys: frozenset[str] = frozenset(source_keys)
        if not self._given:
            raise WorkflowError("a workflow needs at least one MFC")
        self._by_name = _index_by_name(self._given)
        self._producers = _index_producers(self._given, self._source_keys)
        self._deps = {m.name: self._direct_deps(m) for m in self._given}
        self._order = _topological_order(self._given, self._deps)
        self._ancestors = _ancestors(self._order, self._deps)
        self._check_role_ordering()

    def _direct_deps(self, mfc: MFC) -> list[str]:
        deps: list[str] = []
        for key in mfc.inputs:
            if key in self._source_keys:
                continue
            if key not in self._producers:
                available = ", ".join(sorted(self._source_keys | self._producers.keys()))
                raise WorkflowError(
                    f"MFC {mfc.name!r} reads key {key!r}, which no MFC produces and is not a source key;"
                    f" available: {available}"
                )
            producer = self._producers[key]
            if producer not in deps:
                deps.append(producer)
        return deps

    def _check_role_ordering(self) -> None:
        """Every call of a trained role must be ordered by data edges against each of its train calls.

        Otherwise whether the call sees the weights before or after the update would depend on timing.
        """
        for role in self.roles():
            calls = self.mfcs_of_role(role)
            for train in (m for m in calls if m.kind is MFCKind.TRAIN):
                for other in calls:
                    if other is train or self._ordered(other.name, train.name):
                        continue
                    raise WorkflowError(
                        f"MFCs {other.name!r} and {train.name!r} both use role {role!r} but neither depends"
                        f" on the other, so the weights {other.name!r} sees are undefined;"
                        " make one read a key of the other"
                    )

    def _ordered(self, a: str, b: str) -> bool:
        return a in self._ancestors[b] or b in self._ancestors[a]

    def rollout_generations(self) -> tuple[MFC, ...]:
        """The generate calls of trained roles that read only source keys (the prompts): the rollouts an
        asynchronous plan runs ahead of training (:class:`~loomrl.plan.plan.AsyncTraining`), e.g. ``actor_gen`` and
        ReMax's greedy ``actor_gen_greedy``; a judge's generation reads responses and is not one."""
        trained = {m.role for m in self._given if m.kind is MFCKind.TRAIN}
        return tuple(
            m
            for m in self._order
            if m.kind is MFCKind.GENERATE and m.role in trained and all(k in self._source_keys for k in m.inputs)
        )

    def stream_fusable(self) -> tuple[MFC, tuple[MFC, ...]] | None:
        """The calls an inter-stage fusion joins: the first generate call and the inference calls that read
        nothing but its outputs and source keys (so they can run sample by sample as generation finishes
        them); None when no inference call qualifies, or the generate call has no streaming form (episodes)."""
        gens = [m for m in self._order if m.kind is MFCKind.GENERATE]
        if not gens or gens[0].stream is None:
            return None
        consumers = tuple(
            m for m in self._order if m.kind is MFCKind.INFERENCE and self._deps[m.name] == [gens[0].name]
        )
        return (gens[0], consumers) if consumers else None

    def train_pair(self) -> tuple[MFC, MFC] | None:
        """The calls an intra-stage fusion joins: the workflow's two train calls (PPO's actor and critic) when it
        has exactly two, of two roles, neither reading what the other produces; None otherwise."""
        trains = [m for m in self._order if m.kind is MFCKind.TRAIN]
        if len(trains) != 2 or trains[0].role == trains[1].role or not self.independent(trains[0].name, trains[1].name):
            return None
        return trains[0], trains[1]

    def ancestors(self, name: str) -> frozenset[str]:
        """Names of every MFC with a path of data edges to ``name`` within an iteration."""
        return self._ancestors[self[name].name]

    def independent(self, a: str, b: str) -> bool:
        """Whether MFCs ``a`` and ``b`` of one iteration may run side by side: neither reads, through any chain
        of data edges, what the other produces."""
        return a != b and not self._ordered(self[a].name, self[b].name)

    @property
    def source_keys(self) -> frozenset[str]:
        """Keys the dataset provides."""
        return self._source_keys

    @property
    def producers(self) -> dict[str, str]:
        """Map from each MFC-produced key to the name of the MFC producing it."""
        return dict(self._producers)

    def topological_order(self) -> list[MFC]:
        """MFCs ordered so each follows its dependencies; ties keep the order the MFCs were given."""
        return list(self._order)

    def deps(self, name: str) -> list[str]:
        """Names of the MFCs ``name`` directly depends on, in the order of its inputs."""
        return list(self._deps[self[name].name])

    def consumers(self, key: str) -> list[str]:
        """Names of the MFCs reading ``key``, in topological order."""
        if key not in self._source_keys and key not in self._producers:
            available = ", ".join(sorted(self._source_keys | self._producers.keys()))
            raise WorkflowError(f"unknown key {key!r}; available: {available}")
        return [m.name for m in self._order if key in m.inputs]

    def roles(self) -> list[str]:
        """Model roles in the order of their first call in topological order; compute steps excluded."""
        roles: list[str] = []
        for mfc in self._order:
            if mfc.role is not None and mfc.role not in roles:
                roles.append(mfc.role)
        return roles

    def mfcs_of_role(self, role: str) -> list[MFC]:
        """The MFCs running on ``role``'s model, in topological order."""
        calls = [m for m in self._order if m.role == role]
        if not calls:
            raise WorkflowError(f"no MFC uses role {role!r}; roles: {', '.join(self.roles())}")
        return calls

    def __iter__(self) -> Iterator[MFC]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> MFC:
        if name not in self._by_name:
            raise WorkflowError(f"no MFC named {name!r}; MFCs: {', '.join(m.name for m in self._given)}")
        return self._by_name[name]

    def __repr__(self) -> str:
        return f"Workflow({' -> '.join(m.name for m in self._order)})"


def _index_by_name(mfcs: Sequence[MFC]) -> dict[str, MFC]:
    by_name: dict[str, MFC] = {}
    for mfc in mfcs:
        if not isinstance(mfc, MFC):
            raise WorkflowError(f"a workflow is built from MFC objects, got {type(mfc).__name__}")
        if mfc.name in by_name:
            raise WorkflowError(f"two MFCs are named {mfc.name!r}; MFC names must be unique")
        by_name[mfc.name] = mfc
    return by_name


def _index_producers(mfcs: Sequence[MFC], source_keys: frozenset[str]) -> dict[str, str]:
    producers: dict[str, str] = {}
    for mfc in mfcs:
        for key in mfc.outputs:
            if key in source_keys:
                raise WorkflowError(f"MFC {mfc.name!r} produces key {key!r}, which is already a source key")
            if key in producers:
                raise WorkflowError(
                    f"key {key!r} is produced by both {producers[key]!r} and {mfc.name!r};"
                    " each key needs a single producer"
                )
            producers[key] = mfc.name
    return producers


def _topological_order(mfcs: Sequence[MFC], deps: dict[str, list[str]]) -> list[MFC]:
    """Kahn's algorithm, always taking the earliest-given ready MFC so the order is deterministic."""
    position = {m.name: i for i, m in enumerate(mfcs)}
    successors: dict[str, list[str]] = {m.name: [] for m in mfcs}
    pending = {m.name: len(deps[m.name]) for m in mfcs}
    for m in mfcs:
        for d in deps[m.name]:
            successors[d].append(m.name)
    ready = [position[name] for name, count in pending.items() if count == 0]
    heapq.heapify(ready)
    order: list[MFC] = []
    while ready:
        mfc = mfcs[heapq.heappop(ready)]
        order.append(mfc)
        for succ in successors[mfc.name]:
            pending[succ] -= 1
            if pending[succ] == 0:
                heapq.heappush(ready, position[succ])
    if len(order) < len(mfcs):
        stuck = [m.name for m in mfcs if pending[m.name] > 0]
        raise WorkflowError(f"cycle: {' -> '.join(_find_cycle(stuck, deps, position))}")
    return order


def _find_cycle(stuck: list[str], deps: dict[str, list[str]], position: dict[str, int]) -> list[str]:
    """A cycle among the MFCs Kahn's algorithm could not order, in data-flow order, closed.

    Each stuck MFC has a stuck dependency, so walking dependencies from any of them must revisit one.
    """
    stuck_set = set(stuck)
    path: list[str] = []
    seen: dict[str, int] = {}
    node = stuck[0]
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        node = next(d for d in deps[node] if d in stuck_set)
    cycle = path[seen[node] :][::-1]  # walked against the data flow; reverse it
    start = min(range(len(cycle)), key=lambda i: position[cycle[i]])
    cycle = cycle[start:] + cycle[:start]
    return cycle + [cycle[0]]


def _ancestors(order: list[MFC], deps: dict[str, list[str]]) -> dict[str, frozenset[str]]:
    ancestors: dict[str, frozenset[str]] = {}
    for mfc in order:
        acc: set[str] = set()
        for d in deps[mfc.name]:
            acc.add(d)
            acc |= ancestors[d]
        ancestors[mfc.name] = frozenset(acc)
    return ancestors
