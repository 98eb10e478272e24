"""A lower bound on the iteration time of every plan the search can build, from the cost model alone.

Four facts hold for every plan in the search's space (:func:`~loomrl.planner.search.search.candidate_allocations`),
whatever its reallocations, reloads and scheduling add (they only add):

- **Segments**: the simulator runs iterations one after another, as the runtime's trainer does, and a call
  that every other call of the iteration reads from or feeds (a *cut*: PPO's generation and its advantages
  step) runs alone. So the cuts split an iteration into segments that run one after another, and the
  iteration takes at least the sum of the segments' own bounds. PPO's are generation; the three inferences;
  advantages; the two train calls.
- **Work**: a call occupies every device of its mesh for its whole time, so a segment takes at least
  ``Σ seconds × mesh size`` over its calls, divided by the cluster's device count; and, once the calls'
  allocations are known, at least the most time any one device spends in them (calls sharing a device run in
  turn).
- **Dependencies**: the calls of a path of data edges inside a segment run one after another.
- **Memory**: a trained role's training state stays on its training mesh the whole iteration (in the runtime
  and in the simulator), so every call fits on its devices beside the training states placed there: its own
  weights (unless it runs in its role's training placement, on those very weights; any layout on the training
  mesh is let off, which only loosens the bound) plus its transient memory.

So the bound is taken for each *training placement* (one train allocation per trained role, a combination that
fits), and the smallest over them is the bound, since every plan has one. For a placement, every other call
counts only the allocations that fit beside it, and a segment whose allocations it fixes entirely (the train
calls) also takes at least its busiest device's time. Train allocations that another on the same mesh matches
or beats in training state, transient memory and every call's time are dropped first; when the placements
still number more than :data:`PLACEMENTS`, they are not enumerated, and an allocation then counts if it fits
beside the share of the training states (each at its smallest) that the devices outside its mesh cannot hold.

Within a segment, fast calls on many devices are cheap in time and dear in device-seconds (generation's decode
reads the weights once per replica and step), so neither the work nor a path alone is tight. For a path ``P``
and a weight ``λ`` in [0, 1], ``T_segment ≥ λ · Σ_P seconds + (1 − λ) · work / devices`` holds for the plan's
own allocations, hence for the allocations minimizing the right-hand side, which splits into one small minimum
per call (a role's train calls share one allocation and are taken together). A segment's bound is the largest
such value over its paths and a grid of ``λ`` (``λ = 0``: the work with each call at its most frugal
allocation; ``λ = 1``: the longest path with each call at its fastest); each segment chooses its own. Giving
every segment the same ``λ`` and the part of one path through the iteration that falls in it (extended to a
maximal path of the segment) gives back the whole-iteration bound of that ``λ`` and path, so the segments only
tighten it. The figure goes through the estimator's whole-iteration correction like the simulator's.

**Stream fusion.** Where the estimator prices stream fusion (``prices_stream_fusion``,
:mod:`loomrl.planner.cost.stream_fusion`) and
the workflow has calls to fuse, a plan may run generation and the inference calls that read it as one stage, so
the two segments are one and the inference overlaps the generation's tail. The merged segment takes at least the
larger of two figures, each from the estimator's ``stream_fusion_floor`` of every generation allocation
(:func:`~loomrl.planner.cost.stream_fusion.generation_floor`): for each response length ``k``, the time before which no
sample
of length at least ``k`` is ready plus that share of the inference calls' least device-seconds over the
cluster; and the generation's least device-seconds plus all of the inference's, over the cluster. The bound of
a training placement is the least of its unfused and fused sums.

**Pipeline fusion.** Where the estimator prices pipeline fusion (``prices_pipeline_fusion``,
:mod:`loomrl.planner.cost.pipeline_fusion`), two train calls pipelined on the same devices may fill each other's
bubbles, so a device is busy with a call for at least its time without its pipeline bubble (the estimator's
``pipeline_fusion_floor``: a fused step is no shorter than the busiest device's
forwards and backwards), which the work and busiest-device figures count instead of its time; a call's own
time still bounds any path through it (one pipeline alone cannot beat its own 1F1B).

Its use: a heuristic plan within a factor ``f`` of the bound leaves no plan of the space more than ``f``
faster, whatever the search does. What it leaves out, so what separates it from the best plan: the
reallocations and reloads between calls, and the memory that the calls of one segment take *together*.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from loomrl.plan import Allocation, ClusterSpec
from loomrl.planner.cost.estimator import CostEstimator
from loomrl.planner.cost.pipeline_fusion import can_pipeline_fuse
from loomrl.planner.search.candidates import candidate_allocations, unit_names
from loomrl.planner.simulation.simulator import SimResult
from loomrl.workflow import MFCKind, Workflow

__all__ = ["PLACEMENTS", "IterationBound", "SegmentBound", "iteration_bound", "segment_seconds", "segments"]

LAMBDAS = 200
"""Steps of the grid of weights between the longest path and the work bound."""
_GRID = np.arange(LAMBDAS + 1) / LAMBDAS
PLACEMENTS = 20_000
"""Training placements enumerated at most (see the module docstring); a few thousand at 64 devices for PPO."""


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
    busiest: bool = False
    """Whether the busiest device's time (allocations fixed by the training placement) gave it instead."""

    @property
    def limit(self) -> str:
        """What binds: ``"work"`` (weight 0), ``"path"`` (weight 1), ``"both"``, or ``"device"`` (the busiest)."""
        return "device" if self.busiest else {0.0: "work", 1.0: "path"}.get(self.weight, "both")


@dataclass(frozen=True)
class IterationBound:
    """A lower bound on seconds per iteration (see the module docstring)."""

    seconds: float
    """The bound, with the estimator's whole-iteration correction (inf: no plan of the space fits)."""
    segments: tuple[SegmentBound, ...] = ()
    """Each segment's own bound, in the order they run; their seconds sum to the bound before correction."""
    training: tuple[str, ...] = ()
    """The training placement that gave the bound (each trained role's train allocation, ``role=allocation``);
    empty when placements were not enumerated."""


@dataclass(frozen=True)
class _Unit:
    """A unit's allocations that fit a device alone, as arrays over them."""

    names: tuple[str, ...]
    allocs: list[Allocation]
    times: np.ndarray
    """allocations × calls: seconds."""
    sizes: np.ndarray
    devices: np.ndarray
    """allocations × devices: whether the allocation's mesh holds the device."""
    weights: np.ndarray
    """Bytes per device of the role's weights on the allocation (its training state, for a train unit)."""
    transient: np.ndarray
    """Bytes per device the unit's calls add while they run (the most of them)."""
    busy: np.ndarray
    """allocations × calls: seconds the call keeps each device of its mesh busy, at least: its time, or for a
    train call that may fuse with another, its time without its pipeline bubble (module docstring)."""

    def subset(self, keep: list[int]) -> _Unit:
        return _Unit(
            self.names,
            [self.allocs[i] for i in keep],
            self.times[keep],
            self.sizes[keep],
            self.devices[keep],
            self.weights[keep],
            self.transient[keep],
            self.busy[keep],
        )


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


def iteration_bound(
    workflow: Workflow,
    cluster: ClusterSpec,
    cost: CostEstimator,
    memory_per_device: float,
    model_configs: Mapping[str, object],
    deadline: float = math.inf,
) -> IterationBound:
    """The lower bound on any searched plan's iteration time for ``workflow`` on ``cluster`` (module docstring).

    Where devices offload (``cluster.offloads``) a plan may put its trained roles' states to sleep while a
    generation runs, so a generate call need not fit beside them. ``deadline`` (``time.monotonic()`` seconds)
    stops the enumeration of training placements: the bound then falls back to the rule for unenumerated
    placements, which holds for every plan (looser, never wrong)."""
    units = [_unit(names, workflow, cluster, cost, memory_per_device, model_configs) for names in unit_names(workflow)]
    if any(not u.allocs for u in units):  # some call fits nowhere: no plan of the space fits
        return IterationBound(math.inf)
    n = cluster.n_devices
    parts = [
        (calls, _paths(workflow, calls), [i for i, u in enumerate(units) if set(u.names) & set(calls)])
        for calls in segments(workflow)
    ]
    fused = _stream_fusion_segments(workflow, cost, units, [calls for calls, *_ in parts], n)
    trains = [i for i, u in enumerate(units) if workflow[u.names[0]].kind is MFCKind.TRAIN]
    choices = [_undominated(units[i]) for i in trains]
    best: list[SegmentBound] | None = None
    training: tuple[str, ...] = ()
    sleeps = cluster.offloads
    enumerated = math.prod(len(c) for c in choices) <= PLACEMENTS
    if enumerated:
        for combo in itertools.product(*choices):
            if time.monotonic() > deadline:
                enumerated, best, training = False, None, ()
                break
            fixed = {i: units[i].subset([j]) for i, j in zip(trains, combo)}
            masks = _fitting(units, fixed, workflow, n, memory_per_device, sleeps)
            if masks is None:
                continue
            limit = sum(p.seconds for p in best) if best is not None else math.inf
            placed = [fixed.get(i, u) for i, u in enumerate(units)]
            found = _segments_bound(placed, masks, set(fixed), parts, n, limit, fused)
            if found is not None:
                best = found
                training = tuple(
                    f"{workflow[units[i].names[0]].role}={units[i].allocs[j].text}" for i, j in zip(trains, combo)
                )
    if not enumerated:
        masks = _fitting_anywhere(units, workflow, n, memory_per_device, sleeps)
        best = None if masks is None else _segments_bound(units, masks, set(), parts, n, math.inf, fused)
    if best is None:
        return IterationBound(math.inf)
    value = sum(p.seconds for p in best)
    return IterationBound(cost.iteration_time(value), tuple(best), training)


def _unit(
    names: tuple[str, ...],
    workflow: Workflow,
    cluster: ClusterSpec,
    cost: CostEstimator,
    memory: float,
    model_configs: Mapping[str, object],
) -> _Unit:
    """The allocations of the unit ``names`` whose weights and transient memory fit a device alone."""
    mfcs = [workflow[name] for name in names]
    role, train = mfcs[0].role, mfcs[0].kind is MFCKind.TRAIN
    pair = workflow.train_pair()
    pipeline_fusable = (
        train and cost.prices_pipeline_fusion() and pair is not None and any(m.name in names for m in pair)
    )
    rows = []
    for alloc in candidate_allocations(mfcs[0], workflow, cluster, model_configs):
        weights = cost.static_memory(role, alloc, train) if role is not None else 0.0
        transient = max((cost.mfc_memory(m, alloc, train) for m in mfcs if m.role is not None), default=0.0)
        if weights + transient <= memory:
            times = [cost.mfc_time(m, alloc) for m in mfcs]
            busy = [
                cost.pipeline_fusion_floor(m, alloc) if pipeline_fusable and can_pipeline_fuse(alloc) else t
                for m, t in zip(mfcs, times)
            ]
            rows.append((alloc, times, weights, transient, busy))
    devices = np.zeros((len(rows), cluster.n_devices), dtype=bool)
    for k, (alloc, *_) in enumerate(rows):
        devices[k, list(alloc.mesh.devices)] = True
    shape = (len(rows), len(mfcs))
    return _Unit(
        names,
        [r[0] for r in rows],
        np.array([r[1] for r in rows], dtype=float).reshape(shape),
        devices.sum(1).astype(float),
        devices,
        np.array([r[2] for r in rows], dtype=float),
        np.array([r[3] for r in rows], dtype=float),
        np.array([r[4] for r in rows], dtype=float).reshape(shape),
    )


def _undominated(unit: _Unit) -> list[int]:
    """Indices of the train allocations that no other on the same mesh matches or beats in training state,
    transient memory and every call's time (of identical ones, the first): only they can give the least bound,
    since what fits beside a placement depends on its allocations only through their meshes and states (see
    :func:`_fitting`)."""
    keys = np.column_stack([unit.weights, unit.transient, unit.times])
    by_mesh: dict = defaultdict(list)
    for i, alloc in enumerate(unit.allocs):
        by_mesh[alloc.mesh].append(i)
    kept = []
    for members in by_mesh.values():
        for i in members:
            beaten = any(np.all(keys[j] <= keys[i]) and (np.any(keys[j] < keys[i]) or j < i) for j in members if j != i)
            if not beaten:
                kept.append(i)
    return sorted(kept)


def _fitting(
    units: list[_Unit], fixed: dict[int, _Unit], workflow: Workflow, n: int, memory: float, sleeps: bool = False
) -> list[np.ndarray] | None:
    """Per unit, which allocations fit beside the training placement ``fixed`` (unit index → its one train
    allocation); None if the placement itself does not fit. With ``sleeps`` a generate call fits alone (the
    training states may be asleep while it runs)."""
    resident = np.zeros(n)
    for u in fixed.values():
        resident[u.devices[0]] += u.weights[0]
    if any(resident[u.devices[0]].max() + u.transient[0] > memory for u in fixed.values()):
        return None
    training = {workflow[u.names[0]].role: u.devices[0] for u in fixed.values()}  # role → its training mesh
    masks = []
    for i, u in enumerate(units):
        if i in fixed:
            masks.append(np.ones(1, dtype=bool))
            continue
        weights = u.weights
        home = training.get(workflow[u.names[0]].role)
        if home is not None:
            # A call in its role's training placement runs on the training weights themselves. Any layout on the
            # training mesh is let off its weights: looser, but then only the mesh matters (:func:`_undominated`).
            weights = np.where((u.devices == home).all(1), 0.0, weights)
        held = np.where(u.devices, resident, 0.0).max(1)
        if sleeps and workflow[u.names[0]].kind is MFCKind.GENERATE:
            held = np.zeros_like(held)
        masks.append(held + weights + u.transient <= memory)
    return masks


def _fitting_anywhere(
    units: list[_Unit], workflow: Workflow, n: int, memory: float, sleeps: bool = False
) -> list[np.ndarray] | None:
    """Per unit, which allocations fit beside the share of the other trained roles' training states (each at its
    smallest) that the devices outside the mesh cannot hold: the rule when placements are not enumerated (with
    ``sleeps``, generate calls fit alone)."""
    states = {
        workflow[u.names[0]].role: float((u.weights * u.sizes).min())
        for u in units
        if workflow[u.names[0]].kind is MFCKind.TRAIN
    }
    masks = []
    for u in units:
        role = workflow[u.names[0]].role
        others = sum(b for r, b in states.items() if r != role)
        if sleeps and workflow[u.names[0]].kind is MFCKind.GENERATE:
            others = 0.0
        spill = np.maximum(0.0, others - (n - u.sizes) * memory) / u.sizes
        masks.append(u.weights + u.transient + spill <= memory)
    return None if any(not m.any() for m in masks) else masks


@dataclass(frozen=True)
class _StreamFusionSegment:
    """Two segments a fused stage runs as one (module docstring), and the bound on it."""

    first: int
    """Index of the generation's segment; the inference segment follows it."""
    calls: tuple[str, ...]
    seconds: float
    path_bound: bool
    """Whether the longest sample (rather than the work) gave ``seconds``."""


def _stream_fusion_segments(
    workflow: Workflow, cost: CostEstimator, units: list[_Unit], parts: list[tuple[str, ...]], n: int
) -> _StreamFusionSegment | None:
    """The merged segment of a fused stage and its bound, when the estimator prices fusion and gives
    ``stream_fusion_floor``; None otherwise, or when generation and its readers are not two adjacent segments."""
    group = workflow.stream_fusable()
    if group is None or not cost.prices_stream_fusion():
        return None
    gen, readers = group[0].name, {m.name for m in group[1]}
    first = next((k for k, calls in enumerate(parts) if gen in calls), None)
    if first is None or parts[first] != (gen,) or first + 1 >= len(parts) or not readers <= set(parts[first + 1]):
        return None
    gen_unit = next(u for u in units if gen in u.names)
    role = workflow[gen].model_role
    floors = [floor for alloc in gen_unit.allocs if (floor := cost.stream_fusion_floor(role, alloc)) is not None]
    if len(floors) < len(gen_unit.allocs):  # some allocation has none
        return None
    scoring = 0.0  # the inference calls' least device-seconds
    for u in units:
        inside = np.array([name in parts[first + 1] for name in u.names])
        if inside.any() and gen not in u.names:
            scoring += float((u.times[:, inside].sum(1) * u.sizes).min())
    # the samples ready no sooner than t still need their share of the scoring (a call's time over a part of the
    # batch is at least that part of its time over the whole: its fixed costs do not shrink)
    ready = min(max(t + fraction * scoring / n for t, fraction in f.ready) for f in floors)
    work = (min(f.device_seconds for f in floors) + scoring) / n
    return _StreamFusionSegment(first, parts[first] + parts[first + 1], max(ready, work), ready >= work)


def _merged(out: list[SegmentBound], fused: _StreamFusionSegment | None) -> list[SegmentBound]:
    """``out`` with the fused stage's two segments replaced by its one where that is less."""
    if fused is None:
        return out
    k = fused.first
    if fused.seconds >= out[k].seconds + out[k + 1].seconds:
        return out
    weight = 1.0 if fused.path_bound else 0.0
    merged = SegmentBound(fused.calls, fused.seconds, weight, fused.calls[:1])
    return [*out[:k], merged, *out[k + 2 :]]


def _segments_bound(
    units: list[_Unit],
    masks: list[np.ndarray],
    fixed: set[int],
    parts: list[tuple[tuple[str, ...], list[tuple[str, ...]], list[int]]],
    n: int,
    limit: float,
    fused: _StreamFusionSegment | None = None,
) -> list[SegmentBound] | None:
    """Each segment's bound (``parts``: its calls, their paths and the indices of the units holding them) with
    every unit restricted to ``masks``; the units in ``fixed`` hold their one allocation already; the segments of
    a fused stage merged where that is less (``fused``). None if some unit has no allocation left or the sum
    reaches ``limit``."""
    out, total = [], 0.0
    for calls, paths, inside in parts:
        chosen = []
        for i in inside:
            rows = units[i] if i in fixed else units[i].subset(list(np.flatnonzero(masks[i])))
            if not rows.allocs:
                return None
            chosen.append(rows)
        value, weight, path = _weighted(chosen, calls, paths, n)
        busiest = False
        if all(i in fixed for i in inside):  # allocations known: calls sharing a device run in turn
            busy = np.zeros(n)
            for u in chosen:
                busy[u.devices[0]] += sum(t for name, t in zip(u.names, u.busy[0]) if name in calls)
            if busy.max() > value:
                value, busiest = float(busy.max()), True
        out.append(SegmentBound(calls, value, weight, path, busiest))
        total += value
        if fused is None and total >= limit:  # merging may lower the sum: then compare with the limit at the end
            return None
    out = _merged(out, fused)
    return None if sum(p.seconds for p in out) >= limit else out


def _weighted(
    chosen: list[_Unit], calls: tuple[str, ...], paths: list[tuple[str, ...]], n: int
) -> tuple[float, float, tuple[str, ...]]:
    """The largest over ``paths`` and the grid of λ of Σ over units of the least, over their allocations, of
    λ · the path's seconds + (1 − λ) · the segment's seconds × mesh size / ``n``; with its λ and path."""
    best: tuple[float, float, tuple[str, ...]] = (-1.0, 0.0, ())
    for path in paths:
        total = np.zeros(LAMBDAS + 1)
        for u in chosen:
            in_segment = np.array([name in calls for name in u.names])
            on_path = np.array([name in path for name in u.names])
            work = u.busy[:, in_segment].sum(1) * u.sizes / n
            along = u.times[:, on_path].sum(1)
            total += (np.outer(_GRID, along) + np.outer(1.0 - _GRID, work)).min(1)
        k = int(total.argmax())
        if total[k] > best[0]:
            best = (float(total[k]), float(_GRID[k]), path)
    return best


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
            end = (
                ends[it] if j == len(parts) - 1 else max((last.get((it, c), previous) for c in calls), default=previous)
            )
            totals[j] += max(0.0, end - previous)
            previous = max(previous, end)
    return [t / max(len(iterations), 1) for t in totals]


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
