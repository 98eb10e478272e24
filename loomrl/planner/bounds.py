"""A lower bound on the iteration time of every plan the search can build, from the cost model alone.

Three facts hold for every plan in the search's space (:func:`~loomrl.planner.search.candidate_allocations`),
whatever its reallocations, reloads and scheduling add (they only add):

- **Segments**: the simulator runs iterations one after another, as the runtime's trainer does, and a call
  that every other call of the iteration reads from or feeds (a *cut*: PPO's generation and its advantages
  step) runs alone. So the cuts split an iteration into segments that run one after another, and the
  iteration takes at least the sum of the segments' own bounds. PPO's are generation; the three inferences;
  advantages; the two train calls.
- **Work**: a call occupies every device of its mesh for its whole time, so a segment takes at least
  ``Σ seconds × mesh size`` over its calls, divided by the cluster's device count.
- **Dependencies**: the calls of a path of data edges inside a segment run one after another.

Fast calls on many devices are cheap in time and dear in device-seconds (generation's decode reads the weights
once per replica and step), so neither of the last two alone is tight. For a path ``P`` of a segment and a weight
``λ`` in [0, 1], ``T_segment ≥ λ · Σ_P seconds + (1 − λ) · work / devices`` holds for the plan's own allocations,
hence for the allocations minimizing the right-hand side, which splits into one small minimum per call (a role's
train calls share one allocation and are taken together). A segment's bound is the largest such value over its
paths and a grid of ``λ`` (``λ = 0``: the work with each call at its most frugal allocation; ``λ = 1``: the
longest path with each call at its fastest); each segment chooses its own. Only allocations that can fit count:
the call's own memory (resident state plus its transient memory) on each device of its mesh, plus the share of
the trained roles' resident training state (at its smallest over their train allocations) that the devices
outside the mesh cannot hold. The figure goes through the estimator's whole-iteration correction like the
simulator's.

Giving every segment the same ``λ`` and the part of one path through the iteration that falls in it (extended
to a maximal path of the segment) gives back the whole-iteration bound of that ``λ`` and path, so the sum is
never below it: the segments only tighten.

Its use: a heuristic plan within a factor ``f`` of the bound leaves no plan of the space more than ``f``
faster, whatever the search does. What it leaves out, so what separates it from the best plan: the
reallocations and reloads between calls, and the memory the calls of a segment take *together* (each call is
taken at its best allocation that fits beside the training states alone).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from loomrl.plan import ClusterSpec
from loomrl.planner.search import candidate_allocations, memory_alone, unit_names
from loomrl.planner.simulator import CostEstimator, SimResult
from loomrl.workflow import MFCKind, Workflow

__all__ = ["IterationBound", "SegmentBound", "iteration_bound", "segment_seconds", "segments"]

LAMBDAS = 200
"""Steps of the grid of weights between the longest path and the work bound."""


@dataclass(frozen=True)
class SegmentBound:
    """The bound on one segment of an iteration (see the module docstring)."""

    calls: tuple[str, ...]
    """The segment's calls, in topological order."""
    seconds: float
    """The bound on the segment's time, uncorrected."""
    weight: float
    """The ``λ`` that gave it."""
    path: tuple[str, ...]
    """The path of data edges that gave it, in order."""

    @property
    def limit(self) -> str:
        """What binds: ``"work"`` (weight 0), ``"path"`` (weight 1) or ``"both"``."""
        return {0.0: "work", 1.0: "path"}.get(self.weight, "both")


@dataclass(frozen=True)
class IterationBound:
    """A lower bound on seconds per iteration (see the module docstring)."""

    seconds: float
    """The bound, with the estimator's whole-iteration correction (inf: some call fits no device on its own)."""
    work: float
    """The work bound alone (λ = 0 everywhere): least device-seconds of one iteration over the device count."""
    cycle: float
    """The dependency bound alone (λ = 1 everywhere): the longest path through the segments, each call at its
    fastest."""
    segments: tuple[SegmentBound, ...] = ()
    """Each segment's own bound, in the order they run; their seconds sum to the bound before correction."""


def segments(workflow: Workflow) -> list[tuple[str, ...]]:
    """The calls of one iteration split at its cuts (calls ordered with every other call), in running order:
    each cut is a segment of its own, and the calls between two cuts form one."""
    order = [m.name for m in workflow.topological_order()]
    out: list[tuple[str, ...]] = []
    current: list[str] = []
    for name in order:
        if any(workflow.independent(name, other) for other in order):
            current.append(name)
            continue
        if current:
            out.append(tuple(current))
        out.append((name,))
        current = []
    if current:
        out.append(tuple(current))
    return out


def iteration_bound(workflow: Workflow, cluster: ClusterSpec, cost: CostEstimator, memory_per_device: float,
                    model_configs: Mapping[str, object]) -> IterationBound:
    """The lower bound on any searched plan's iteration time for ``workflow`` on ``cluster`` (module docstring)."""
    states = _training_states(workflow, cluster, cost, memory_per_device, model_configs)
    options = {names: _options(names, workflow, cluster, cost, memory_per_device, model_configs, states)
               for names in unit_names(workflow)}
    if not all(options.values()):  # some call fits nowhere: no plan of the space fits
        return IterationBound(math.inf, math.inf, math.inf)
    n = cluster.n_devices
    parts, work, cycle = [], 0.0, 0.0
    for calls in segments(workflow):
        # A unit's calls outside the segment do not count here. Letting a unit's allocation differ between
        # segments only relaxes the bound (a role's train calls share one in every plan).
        units = [(names, opts) for names, opts in options.items() if any(name in calls for name in names)]
        paths = _paths(workflow, calls)
        value, weight, path = max(((_segment_bound(units, calls, step / LAMBDAS, p, n), step / LAMBDAS, p)
                                   for p in paths for step in range(LAMBDAS + 1)), key=lambda t: t[0])
        parts.append(SegmentBound(calls, value, weight, path))
        work += _segment_bound(units, calls, 0.0, (), n)
        cycle += max(_segment_bound(units, calls, 1.0, p, n) for p in paths)
    value = sum(part.seconds for part in parts)
    corrected = getattr(cost, "iteration_time", None)
    seconds = corrected(value) if corrected is not None else value
    return IterationBound(seconds, work, cycle, tuple(parts))


def segment_seconds(result: SimResult, parts: list[tuple[str, ...]]) -> list[float]:
    """Seconds each segment (``parts``, from :func:`segments`) takes in a simulated plan, to set beside its bound.

    A segment runs from the end of the previous one's last call (the iteration's start, for the first) to the end
    of its own last call, so the reallocations and reloads before a call count in its segment; the last segment
    runs to the iteration's end (syncs after training included). Averaged over the iterations that give the
    steady-state time, uncorrected like :attr:`SegmentBound.seconds`."""
    ends = result.iteration_ends
    iterations = range(1, len(ends)) if len(ends) > 1 else range(len(ends))
    last: dict[tuple[int, str], float] = {}
    for iv in result.timeline:
        key = (iv.iteration, iv.label)
        last[key] = max(last.get(key, 0.0), iv.end)
    totals = [0.0] * len(parts)
    for it in iterations:
        previous = ends[it - 1] if it > 0 else 0.0
        for j, calls in enumerate(parts):
            end = ends[it] if j == len(parts) - 1 else max((last.get((it, c), previous) for c in calls),
                                                            default=previous)
            totals[j] += max(0.0, end - previous)
            previous = max(previous, end)
    return [t / max(len(iterations), 1) for t in totals]


def _segment_bound(units: list[tuple[tuple[str, ...], list[tuple[tuple[float, ...], int]]]], calls: tuple[str, ...],
                   weight: float, path: tuple[str, ...], n: int) -> float:
    """``weight`` × the path's seconds + (1 − ``weight``) × the segment's work / ``n``, each unit at the allocation
    that minimizes its part."""
    return sum(min(sum(t * (weight * (name in path) + (1.0 - weight) * size / n)
                       for name, t in zip(names, times) if name in calls)
                   for times, size in opts)
               for names, opts in units)


def _training_states(workflow: Workflow, cluster: ClusterSpec, cost: CostEstimator, memory_per_device: float,
                     model_configs: Mapping[str, object]) -> dict[str, float]:
    """Trained role → the fewest bytes, summed over devices, its resident training state takes on any train
    allocation that fits a device alone (FSDP's or ZeRO's sharding included)."""
    states = {}
    for names in unit_names(workflow):
        mfc = workflow[names[0]]
        if mfc.kind is MFCKind.TRAIN:
            per_device = ((cost.static_memory(mfc.role, a, True), len(a.mesh))
                          for a in candidate_allocations(mfc, workflow, cluster, model_configs))
            states[mfc.role] = min((b * k for b, k in per_device if b <= memory_per_device), default=math.inf)
    return states


def _options(names: tuple[str, ...], workflow: Workflow, cluster: ClusterSpec, cost: CostEstimator,
             memory_per_device: float, model_configs: Mapping[str, object],
             states: Mapping[str, float]) -> list[tuple[tuple[float, ...], int]]:
    """(each call's seconds, mesh size) of every allocation of the unit ``names`` that can fit (none: the unit
    fits nowhere).

    An allocation of ``k`` of the cluster's ``n`` devices fits only if the call's memory per device plus the
    trained roles' training state that cannot sit elsewhere fits: the other ``n - k`` devices hold at most
    ``(n - k) · capacity`` of the ``states`` bytes, so some device of the mesh holds an ``1 / k`` share of the
    rest. The call's own role is counted once, as its weights on the allocation (its training state, for a
    train call): a trained role's other calls may run on the training weights themselves."""
    mfcs = [workflow[name] for name in names]
    resident = sum(b for role, b in states.items() if role != mfcs[0].role)
    n, out = cluster.n_devices, set()
    for alloc in candidate_allocations(mfcs[0], workflow, cluster, model_configs):
        k = len(alloc.mesh)
        need = memory_alone(mfcs, alloc, cost)
        if need + max(0.0, resident - (n - k) * memory_per_device) / k <= memory_per_device:
            out.add((tuple(cost.mfc_time(m, alloc) for m in mfcs), k))
    return sorted(out)


def _paths(workflow: Workflow, calls: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Every maximal path of data edges among ``calls`` (from a call none of them feeds to one that feeds none of
    them), as the calls in order; a lone call is a path of its own."""
    inside = set(calls)
    successors = {name: [m for m in calls if name in workflow.deps(m)] for name in calls}
    paths: list[tuple[str, ...]] = []

    def walk(path: tuple[str, ...]) -> None:
        if not successors[path[-1]]:
            paths.append(path)
            return
        for nxt in successors[path[-1]]:
            walk(path + (nxt,))

    for name in calls:
        if not inside.intersection(workflow.deps(name)):
            walk((name,))
    return paths
