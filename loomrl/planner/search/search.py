"""Plan search: simulated annealing over one candidate allocation per MFC, and the heuristic baselines.

- :func:`candidate_allocations`: where one MFC may run. Meshes are contiguous device ranges whose size is a
  power of two inside a node (aligned to a multiple of that size within the node), or a power-of-two number
  of whole nodes (aligned likewise), plus the whole cluster. Layouts are ``dp × tp × pp`` equal to the mesh
  size that the runtime can run (:func:`loomrl.plan.layout.check_layout`: tp divides the heads, key/value
  heads and MLP width, pp divides the layers), with every tensor-parallel group inside one node; generation
  runs with pp = 1. Train and inference calls also choose micro-batches (:data:`MICRO_BATCHES`: memory for
  inference, pipelining too for both); train calls whether to recompute
  activations and, with dp > 1, whether to shard the optimizer state (ZeRO-1) or, without pipeline stages,
  the weights, gradients and optimizer state too (FSDP). A compute step may run on any single device.
- :func:`search`: the candidates are first pruned per device mesh to the few fastest layouts alone that fit
  the devices alone, and the leanest (:func:`_prune`, as ReaLHF prunes its search space); then Metropolis
  acceptance with a geometric cooling schedule, then the few best plans settled by coordinate descent (with
  interleaving moves, :class:`_Splitter`); a move gives one MFC (or all the train calls of a role together,
  since they share a placement), sometimes two, another candidate, half the time on its current mesh (a
  layout or micro-batch move). Several
  independent chains share the wall-clock budget and a
  cache of simulated plans; the top-k distinct feasible plans seen by any chain are returned, fastest first.
  Searched plans use the default shadow rule of :class:`~loomrl.plan.ExecutionPlan`; which frozen roles are
  offloaded between their calls is settled by the polish (offloading saves memory, and costs a reload before
  each call on accelerators), and the chains start from heuristic plans with either choice.
- :func:`best_heuristic_plans`: colocate, interleave and separate, each with its best layouts on the meshes
  the strategy chose (and, for separate, the best number of generation devices), so the search's gain over
  them is always visible. A heuristic's layouts are symmetric: every call of a role on a mesh uses the same
  one, as in the Megatron-based systems ReaLHF compares with (``per_call=True`` gives each call its own, a
  stronger baseline that already uses reallocation).

Determinism: the chains draw from ``random.Random`` seeded by ``(seed, chain)``; with ``max_steps`` reached
before the time budget, the same seed gives the same plans. Infeasible plans guide the walk (their energy is
their time inflated by how far the devices overflow: peaks and overflow over time, summed over devices) but
are never returned.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from loomrl.errors import ConfigError
from loomrl.plan import Allocation, ClusterSpec, DeviceSet, ExecutionPlan, colocate, interleave, separate
from loomrl.plan.layout import Layout, check_layout
from loomrl.plan.model_shape import ModelShape
from loomrl.plan.plan import StreamFusion
from loomrl.plan.schedule import Step
from loomrl.planner.cost.estimator import CostEstimator
from loomrl.planner.cost.pipeline_fusion import can_pipeline_fuse
from loomrl.planner.cost.stream_fusion import GenerationFloor, Part
from loomrl.planner.simulation.simulator import SimResult, simulate
from loomrl.workflow import MFC, MFCKind, Workflow

__all__ = [
    "CachedCost",
    "MICRO_BATCHES",
    "RUNTIME_ARCHITECTURES",
    "best_heuristic_plans",
    "candidate_allocations",
    "device_meshes",
    "layouts_on",
    "memory_alone",
    "plan_key",
    "search",
    "shardable",
    "unit_names",
]

MICRO_BATCHES: tuple[int, ...] = (1, 2, 4, 8)
"""Micro-batch counts a train call may choose."""

ENUMERATION_LIMIT = 256
"""A heuristic plan's layout combinations are enumerated exhaustively up to this many, else coordinate-wise."""

_MAX_SWEEPS = 6
"""Coordinate-wise sweeps :func:`_best_layouts` makes at most (each sweep that changes nothing ends it)."""

TOP_PER_MESH = 4
"""Allocations a unit keeps per device mesh in the search: its fastest alone among those that fit the devices
alone (as ReaLHF keeps a few best parallel strategies per mesh), see :func:`_prune`."""
LEAN_PER_MESH = 2
"""More allocations kept per mesh: those needing the least memory, so tight setups can still be fitted."""

_PlanKey = tuple


def plan_key(plan: ExecutionPlan) -> _PlanKey:
    """A hashable identity of a plan: its allocations' texts by MFC name, its shadow and offload choices and its
    fusions."""
    choices = tuple((chosen is not None, chosen or ()) for chosen in (plan.shadow, plan.offload))  # None: default
    fusion = (
        "" if plan.stream_fusion is None else plan.stream_fusion.text
    )  # a string either way: keys are compared on ties
    return tuple(sorted((n, a.text) for n, a in plan.allocations.items())), *choices, fusion, plan.pipeline_fusion


def _powers_of_two(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]


def device_meshes(cluster: ClusterSpec) -> list[DeviceSet]:
    """The candidate meshes of ``cluster`` (see the module docstring), smallest first, then by first device."""
    per_node, nodes = cluster.devices_per_node, cluster.nodes
    spans: set[tuple[int, int]] = {(0, cluster.n_devices)}
    for size in _powers_of_two(per_node):
        for node in range(nodes):
            spans |= {(node * per_node + off, size) for off in range(0, per_node - size + 1, size)}
    for k in _powers_of_two(nodes):
        spans |= {(node * per_node, k * per_node) for node in range(0, nodes - k + 1, k)}
    return [DeviceSet(tuple(range(first, first + size))) for first, size in sorted(spans, key=lambda s: (s[1], s[0]))]


def _tp_within_nodes(mesh: DeviceSet, tp: int, cluster: ClusterSpec) -> bool:
    """Whether each tensor-parallel group (``tp`` consecutive ranks) sits on one node."""
    return all(len({cluster.node_of(d) for d in mesh.devices[g : g + tp]}) == 1 for g in range(0, len(mesh), tp))


def layouts_on(mfc: MFC, mesh: DeviceSet, cluster: ClusterSpec, config: object | None) -> list[Layout]:
    """Layouts of ``mfc``'s model on ``mesh`` that the runtime can run (module docstring); pure dp first. A role
    with no model (``config`` None: a rule reward) runs data-parallel only; an architecture loomrl's runtime
    does not build (Qwen3, OPT, mixtures of experts: described for planning) takes the layouts serving and
    training systems run it in (:func:`shardable`)."""
    n, found = len(mesh), []
    if config is None:
        return [Layout(dp=n)]
    for tp in (t for t in range(1, min(n, cluster.devices_per_node) + 1) if n % t == 0):
        if not _tp_within_nodes(mesh, tp, cluster):
            continue
        for pp in (p for p in range(1, n // tp + 1) if (n // tp) % p == 0):
            if pp > 1 and mfc.kind is MFCKind.GENERATE:
                continue
            layout = Layout(n // (tp * pp), tp, pp)
            if shardable(layout, config, n):
                found.append(layout)
    return found


RUNTIME_ARCHITECTURES = ("llama", "qwen2", "gpt2")
"""``model_type`` values loomrl's runtime builds (its zoo's): their layouts must pass the runtime's own check."""


def shardable(layout: Layout, config: object, devices: int) -> bool:
    """Whether ``layout`` can shard the model of ``config``: the runtime's check (:func:`check_layout`) for the
    architectures it builds; for others, what vLLM and Megatron accept: tp divides the query heads and the MLP
    (or expert) width, and divides or is a multiple of the key/value heads (which are then replicated); pp
    divides the layers."""
    if getattr(config, "model_type", None) in RUNTIME_ARCHITECTURES:
        try:
            check_layout(layout, config, devices)
        except ConfigError:
            return False
        return True
    d = ModelShape.from_config(config)
    width = d.expert_intermediate if d.experts else d.intermediate
    tp_ok = (
        d.heads % layout.tp == 0
        and width % layout.tp == 0
        and (d.kv_heads % layout.tp == 0 or layout.tp % d.kv_heads == 0)
    )
    return layout.size == devices and tp_ok and d.layers % layout.pp == 0


def _config(mfc: MFC, model_configs: Mapping[str, object]) -> object:
    role = mfc.role
    if role is None or role not in model_configs:
        raise ConfigError(
            f"model_configs: no config for role '{role}' (MFC {mfc.name}); given: {', '.join(model_configs) or 'none'}"
        )
    return model_configs[role]


def _allocations_on(
    mfc: MFC, mesh: DeviceSet, cluster: ClusterSpec, model_configs: Mapping[str, object]
) -> list[Allocation]:
    """Every layout of ``mfc`` on ``mesh`` (× micro-batches for train and inference calls; × recompute and, where
    dp > 1, ZeRO-1 for a train call, or FSDP for one without pipeline stages)."""
    if mfc.kind is MFCKind.COMPUTE:
        return [Allocation(mesh, Layout(dp=len(mesh)))]
    train = mfc.kind is MFCKind.TRAIN
    counts = MICRO_BATCHES if mfc.kind in (MFCKind.TRAIN, MFCKind.INFERENCE) else (1,)  # scoring is micro-batched
    recompute = (False, True) if train else (False,)
    out = []
    for layout in layouts_on(mfc, mesh, cluster, _config(mfc, model_configs)):
        shardings = [(False, False)]  # (zero, fsdp)
        if train and layout.dp > 1:
            shardings += [(True, False)] + ([(False, True)] if layout.pp == 1 else [])
        out += [
            Allocation(mesh, layout, mb, rc, zero, fsdp)
            for mb in counts
            for rc in recompute
            for zero, fsdp in shardings
        ]
    return out


def candidate_allocations(
    mfc: MFC, workflow: Workflow, cluster: ClusterSpec, model_configs: Mapping[str, object]
) -> list[Allocation]:
    """Where ``mfc`` of ``workflow`` may run on ``cluster`` (module docstring); ``model_configs`` maps a role to
    its HF-config-like object (heads, key/value heads, MLP width, layers)."""
    mfc = workflow[mfc.name]
    if mfc.kind is MFCKind.COMPUTE:
        return [Allocation(DeviceSet((d,)), Layout()) for d in range(cluster.n_devices)]
    return [a for mesh in device_meshes(cluster) for a in _allocations_on(mfc, mesh, cluster, model_configs)]


@dataclass(frozen=True)
class _Unit:
    """MFCs that move together (one, or a role's train calls) and their candidate allocations."""

    names: tuple[str, ...]
    candidates: tuple[Allocation, ...]


def unit_names(workflow: Workflow) -> list[tuple[str, ...]]:
    """Groups of MFC names that share one allocation: a role's train calls together, every other MFC alone."""
    units: list[tuple[str, ...]] = []
    seen: set[str] = set()
    for mfc in workflow.topological_order():
        if mfc.name in seen:
            continue
        names: tuple[str, ...] = (mfc.name,)
        if mfc.kind is MFCKind.TRAIN:
            names = tuple(m.name for m in workflow.mfcs_of_role(mfc.model_role) if m.kind is MFCKind.TRAIN)
        seen |= set(names)
        units.append(names)
    return units


class _Evaluator:
    """Simulates each distinct plan once; wraps the cost estimator in a cache shared by all plans."""

    def __init__(self, workflow: Workflow, cost: CostEstimator, memory_per_device: float, iterations: int) -> None:
        self.workflow, self.cost = workflow, cost if isinstance(cost, CachedCost) else CachedCost(cost)
        self.memory, self.iterations = memory_per_device, iterations
        self.results: dict[_PlanKey, tuple[ExecutionPlan, SimResult | None]] = {}

    def __call__(self, plan: ExecutionPlan) -> SimResult | None:
        """The plan's simulation, or None if the plan is structurally invalid."""
        key = plan_key(plan)
        if key not in self.results:
            try:
                plan.validate(self.workflow)
            except ConfigError:
                self.results[key] = (plan, None)
            else:  # errors in the arguments or the cost estimator are not the plan's fault: they propagate
                self.results[key] = (plan, simulate(plan, self.workflow, self.cost, self.memory, self.iterations))
        return self.results[key][1]

    def energy(self, plan: ExecutionPlan) -> float:
        """Iteration time when feasible; inflated by the worst overflow when not; infinite when invalid."""
        result = self(plan)
        if result is None:
            return math.inf
        if result.feasible:
            return result.iteration_time
        # every overflowing device and every overflowing call counts (peaks, and the overflow over time), so
        # fixing any one of them is progress the walk can see
        overflow = sum(max(0.0, peak / self.memory - 1.0) for peak in result.peak_memory.values())
        assert result.makespan is not None  # SimResult.__post_init__ sets it
        overflow += result.overflow_byte_seconds / (self.memory * max(result.makespan, 1e-9))
        return max(result.iteration_time, 1e-9) * (2.0 + 10.0 * overflow)

    def best(self, k: int) -> list[tuple[ExecutionPlan, SimResult]]:
        """The ``k`` fastest feasible plans simulated so far; ties go to fewer device-seconds, then to the plan
        key, so the order is deterministic."""
        found = [
            ((r.iteration_time, r.device_seconds, key), plan, r)
            for key, (plan, r) in self.results.items()
            if r is not None and r.feasible
        ]
        found.sort(key=lambda item: item[0])
        return [(plan, r) for _, plan, r in found[:k]]

    def rank(self, plan: ExecutionPlan) -> tuple:
        """Sort key of a plan: feasible first, then energy, then device-seconds used, then the plan's key."""
        result = self(plan)
        busy = result.device_seconds if result is not None else math.inf  # among equally fast, more room wins
        return result is None or not result.feasible, self.energy(plan), busy, plan_key(plan)


class CachedCost(CostEstimator):
    """A :class:`~loomrl.planner.cost.estimator.CostEstimator` that asks the wrapped one once per distinct question
    of time or memory, and passes every other question on: pass one to :func:`best_heuristic_plans` and
    :func:`search` to share what either has priced (reallocations cost tens of milliseconds each on a large
    cluster)."""

    def __init__(self, inner: CostEstimator) -> None:
        self.inner = inner
        self.cache: dict[tuple, float] = {}

    def _ask(self, key: tuple, fn) -> float:
        if key not in self.cache:
            self.cache[key] = fn()
        return self.cache[key]

    def mfc_time(self, mfc: MFC, alloc: Allocation) -> float:
        return self._ask(("t", mfc.name, alloc), lambda: self.inner.mfc_time(mfc, alloc))

    def mfc_memory(self, mfc: MFC, alloc: Allocation, trainable: bool) -> float:
        return self._ask(("m", mfc.name, alloc, trainable), lambda: self.inner.mfc_memory(mfc, alloc, trainable))

    def static_memory(self, role: str, alloc: Allocation, trainable: bool) -> float:
        return self._ask(("s", role, alloc, trainable), lambda: self.inner.static_memory(role, alloc, trainable))

    def realloc_time(self, role: str, src: Allocation, dst: Allocation) -> float:
        return self._ask(("r", role, src, dst), lambda: self.inner.realloc_time(role, src, dst))

    def reload_time(self, role: str, alloc: Allocation, trainable: bool = False) -> float:
        return self._ask(("l", role, alloc, trainable), lambda: self.inner.reload_time(role, alloc, trainable))

    def offload_time(self, role: str, alloc: Allocation, trainable: bool = False) -> float:
        return self._ask(("o", role, alloc, trainable), lambda: self.inner.offload_time(role, alloc, trainable))

    def offloads(self) -> bool:
        return self.inner.offloads()

    def shared_cores(self) -> float | None:
        return self.inner.shared_cores()

    def iteration_time(self, simulated_s: float) -> float:
        return self.inner.iteration_time(simulated_s)

    def prices_stream_fusion(self) -> bool:
        return self.inner.prices_stream_fusion()

    def stream_fusion_time(self, step: Step) -> float:
        return self.inner.stream_fusion_time(step)

    def stream_fusion_parts(self, step: Step) -> tuple[Part, ...]:
        return self.inner.stream_fusion_parts(step)

    def stream_fusion_floor(self, role: str, alloc: Allocation) -> GenerationFloor | None:
        return self.inner.stream_fusion_floor(role, alloc)

    def prices_pipeline_fusion(self) -> bool:
        return self.inner.prices_pipeline_fusion()

    def pipeline_fusion_time(self, step: Step) -> float:
        return self.inner.pipeline_fusion_time(step)

    def pipeline_fusion_floor(self, mfc: MFC, alloc: Allocation) -> float:
        return self.inner.pipeline_fusion_floor(mfc, alloc)


def _move(plan: ExecutionPlan, unit: _Unit, rng: random.Random) -> dict[str, Allocation]:
    """New allocations for ``unit``: another candidate, half the time on its current mesh."""
    current = plan[unit.names[0]]
    others = [a for a in unit.candidates if a != current]
    local = [a for a in others if a.mesh == current.mesh]
    pool = local if local and rng.random() < 0.5 else others
    choice = pool[rng.randrange(len(pool))]
    return dict.fromkeys(unit.names, choice)


class _Splitter:
    """Interleaving moves: two independent units (no data path between their calls, e.g. the reference's and the
    reward model's inference, or the actor's and the critic's training) leave the mesh of one of them for its
    two halves, one each, each on its fastest candidate there that fits a device alone (the fastest of all where
    none fits); or, from two halves, both move back onto the whole mesh.

    From two calls that share a mesh, moving either alone onto a half is uphill (the other still waits for the
    whole mesh), and a random pair of moves rarely draws the two complementary allocations among hundreds; so
    the walk seldom reaches such a plan at 64 devices. This is the adaptive-placement paper's interleaving as
    one move, made by the polish (:func:`_polish`), which keeps it only where it helps. (Made by the walk too, a
    tenth of its proposals, it found faster plans at 34B and 70B and slower ones at 13B, whose walks had
    converged: the moves spent steps and took the chains elsewhere; the plan_search benchmark.)"""

    def __init__(self, units: list[_Unit], workflow: Workflow, cost: CostEstimator, memory_per_device: float):
        self.units = units
        self.pairs = [
            (i, j)
            for i, j in itertools.combinations(range(len(units)), 2)
            if all(workflow.independent(a, b) for a in units[i].names for b in units[j].names)
        ]
        self.fastest: dict[tuple[int, DeviceSet], Allocation] = {}
        for k, unit in enumerate(units):
            by_mesh = _scored_by_mesh([workflow[n] for n in unit.names], unit.candidates, cost)
            for mesh, scored in by_mesh.items():
                best = min(scored, key=lambda t: (t[1] > memory_per_device, t))
                self.fastest[(k, mesh)] = unit.candidates[best[2]]

    def halves(self, mesh: DeviceSet, i: int, j: int) -> tuple[DeviceSet, DeviceSet] | None:
        """The two halves of ``mesh`` when both units have candidates on both."""
        n = len(mesh)
        if n < 2 or n % 2:
            return None
        lo, hi = DeviceSet(mesh.devices[: n // 2]), DeviceSet(mesh.devices[n // 2 :])
        if all((k, half) in self.fastest for k in (i, j) for half in (lo, hi)):
            return lo, hi
        return None

    def moves(self, plan: ExecutionPlan, i: int, j: int) -> list[ExecutionPlan]:
        """``plan`` with units ``i`` and ``j`` on the halves of either one's mesh, in both orders; and, when
        they sit on the two halves of a mesh already, both on that whole mesh (the move back)."""
        out = []
        meshes = [plan[self.units[k].names[0]].mesh for k in (i, j)]
        for mesh in dict.fromkeys(meshes):
            halves = self.halves(mesh, i, j)
            if halves is None:
                continue
            for first, second in ((i, j), (j, i)):
                changes = dict.fromkeys(self.units[first].names, self.fastest[(first, halves[0])])
                changes |= dict.fromkeys(self.units[second].names, self.fastest[(second, halves[1])])
                out.append(_with(plan, changes))
        whole = DeviceSet(tuple(sorted({*meshes[0], *meshes[1]})))
        if all((k, whole) in self.fastest for k in (i, j)) and set(self.halves(whole, i, j) or ()) == set(meshes):
            out.append(_with(plan, {name: self.fastest[(k, whole)] for k in (i, j) for name in self.units[k].names}))
        return out


def _with(plan: ExecutionPlan, changes: Mapping[str, Allocation]) -> ExecutionPlan:
    return dataclasses.replace(
        plan, allocations={name: changes.get(name, alloc) for name, alloc in plan.allocations.items()}
    )


def _propose(plan: ExecutionPlan, units: list[_Unit], rng: random.Random) -> ExecutionPlan:
    """One MFC group moved to another candidate, or, a quarter of the time, two groups at once: moving two
    calls side by side is often worse one at a time than together. The plan's offload choice is kept (the
    polish settles it: it hardly interacts with the layouts, and random switches would spend the walk's
    steps)."""
    count = 2 if len(units) > 1 and rng.random() < 0.25 else 1
    changes: dict[str, Allocation] = {}
    for index in rng.sample(range(len(units)), count):
        changes |= _move(plan, units[index], rng)
    return _with(plan, changes)


def _offload_choices(plan: ExecutionPlan, evaluate: _Evaluator, trained: bool = True) -> list[str]:
    """Roles the search may offload or keep resident, when the estimator prices reloading them (without a price,
    offloading only saves memory, so the default rule's choice is never worse) and the devices offload at all
    (CPU devices do not: the choice would change nothing): those without a train call, and with ``trained``
    the trained ones too, whose state then sleeps through the generations on their devices."""
    if not evaluate.cost.offloads():
        return []
    frozen = set(evaluate.workflow.roles()) - set(plan.trained_roles(evaluate.workflow))
    return [role for role in evaluate.workflow.roles() if trained or role in frozen]


def _toggle_offload(plan: ExecutionPlan, workflow: Workflow, role: str) -> ExecutionPlan:
    """``plan`` with ``role`` offloaded between its calls if it was not, resident if it was (the offloaded
    set made explicit, in workflow order)."""
    offloaded = set(plan.offloaded_roles(workflow)) ^ {role}
    return dataclasses.replace(plan, offload=tuple(r for r in workflow.roles() if r in offloaded))


def stream_fusion_choices(plan: ExecutionPlan, evaluate: _Evaluator) -> list[StreamFusion | None]:
    """The fusions the search tries on ``plan`` (the current one left out), when the estimator prices fused
    stages and the workflow has calls to fuse: none, and ``migrate_at: auto`` onto one replica or, with four or
    more generation replicas, onto a quarter of them (RLHFuse moves the tail onto a few instances)."""
    group = evaluate.workflow.stream_fusable()
    if not evaluate.cost.prices_stream_fusion() or group is None:
        return []
    replicas = plan[group[0].name].layout.dp
    options: list[StreamFusion | None] = [None, StreamFusion(migrate_at="auto", migrate_to=1)]
    if replicas >= 4:
        options.append(StreamFusion(migrate_at="auto", migrate_to=replicas // 4))
    return [f for f in options if f != plan.stream_fusion]


def pipeline_fusion_twin(plan: ExecutionPlan, evaluate: _Evaluator) -> ExecutionPlan | None:
    """``plan`` with its train calls fused if they are not and could be, unfused if they are; None when the
    estimator does not price fused training or the workflow has no train pair. Fusing reverses the second call's
    pipeline (its stage 0 on the mesh's last device), so the two run in opposite directions; unfusing restores
    its plain order."""
    pair = evaluate.workflow.train_pair()
    if not evaluate.cost.prices_pipeline_fusion() or pair is None:
        return None
    first, second = (plan[m.name] for m in pair)
    if plan.pipeline_fusion:
        plain = dataclasses.replace(second.layout, reverse=False)
        return dataclasses.replace(
            _with(plan, {pair[1].name: dataclasses.replace(second, layout=plain)}), pipeline_fusion=False
        )
    if first.mesh != second.mesh or not (can_pipeline_fuse(first) and can_pipeline_fuse(second)):
        return None
    flipped = dataclasses.replace(second.layout, reverse=not first.layout.reverse)
    return dataclasses.replace(
        _with(plan, {pair[1].name: dataclasses.replace(second, layout=flipped)}), pipeline_fusion=True
    )


def _anneal(
    start: ExecutionPlan,
    units: list[_Unit],
    evaluate: _Evaluator,
    rng: random.Random,
    deadline: float,
    max_steps: int | None,
) -> None:
    """One Metropolis chain from ``start`` until ``max_steps`` or ``deadline``; results land in ``evaluate``."""
    current, e_current = start, evaluate.energy(start)
    scale = e_current if 0 < e_current < math.inf else 1.0
    t_high, t_low = 0.05 * scale, 1e-4 * scale  # accept 5% slower moves freely at first, almost none at the end
    began, step = time.monotonic(), 0
    while max_steps is None or step < max_steps:
        now = time.monotonic()
        if now >= deadline:
            break
        progress = step / max_steps if max_steps else (now - began) / max(deadline - began, 1e-9)
        temperature = t_high * (t_low / t_high) ** min(progress, 1.0)
        proposal = _propose(current, units, rng)
        e_new = evaluate.energy(proposal)
        if e_new <= e_current or (e_new < math.inf and rng.random() < math.exp(-(e_new - e_current) / temperature)):
            current, e_current = proposal, e_new
        step += 1


def _polish(
    best: ExecutionPlan, units: list[_Unit], evaluate: _Evaluator, deadline: float, splitter: _Splitter | None = None
) -> None:
    """Coordinate descent from ``best``: generation fused with the inference that reads it or not
    (:func:`stream_fusion_choices`), then each unit in turn takes its best candidate with the others fixed, then each
    pair of independent units tries the halves of either one's mesh (``splitter``), then each frozen role
    offloaded or resident, sweeping until a sweep improves nothing or the deadline passes (results land in
    ``evaluate``). Annealing finds the region; this settles it on the local optimum, which random proposals
    reach only by luck."""
    current, rank = best, evaluate.rank(best)
    group = evaluate.workflow.stream_fusable()
    generating = group[0].name if group is not None else None

    def trials():  # each built from the plan current when it is drawn
        for fusion in stream_fusion_choices(current, evaluate):  # fused or not: cheap to try, and it moves a lot
            yield dataclasses.replace(current, stream_fusion=fusion)
        if (twin := pipeline_fusion_twin(current, evaluate)) is not None:
            yield twin
        for unit in units:
            for alloc in unit.candidates:
                trial = _with(current, dict.fromkeys(unit.names, alloc))
                yield trial
                if not trial.pipeline_fusion and (twin := pipeline_fusion_twin(trial, evaluate)) is not None:
                    yield twin  # pipelines that could fuse: fused too
                if generating in unit.names:  # a generation layout that pays only fused (or only unfused)
                    for fusion in stream_fusion_choices(trial, evaluate):
                        yield dataclasses.replace(trial, stream_fusion=fusion)
        if splitter is not None:
            for i, j in splitter.pairs:
                yield from splitter.moves(current, i, j)
        for role in _offload_choices(current, evaluate):  # offloaded or resident
            yield _toggle_offload(current, evaluate.workflow, role)

    while time.monotonic() < deadline:
        before = rank
        for trial in trials():
            if time.monotonic() >= deadline:
                return
            trial_rank = evaluate.rank(trial)
            if trial_rank < rank:
                current, rank = trial, trial_rank
        if rank >= before:
            return


def _crossovers(starts: list[ExecutionPlan], workflow: Workflow) -> list[ExecutionPlan]:
    """Each start with every call of one kind (generation, inference or training) placed as in another start,
    in a fixed order: e.g. colocated generation and inference with interleave's actor and critic training side
    by side. Such a plan combines the fast parts of two strategies; a walk of single moves reaches it only
    through the slower plans between, which at 64 devices it rarely crosses in its budget."""
    out = []
    for a, b in itertools.permutations(starts, 2):
        for kind in (MFCKind.GENERATE, MFCKind.INFERENCE, MFCKind.TRAIN):
            moved = {m.name for m in workflow if m.kind is kind}
            allocations = {n: b[n] if n in moved else alloc for n, alloc in a.allocations.items()}
            out.append(dataclasses.replace(a, allocations=allocations, shadow=None))
    return out


def memory_alone(mfcs: list[MFC], alloc: Allocation, cost: CostEstimator) -> float:
    """Bytes per device the calls of one unit need on ``alloc`` with nothing else there: their role's weights
    (its training state, for train calls) and the most transient memory any of them adds."""
    trainable = mfcs[0].kind is MFCKind.TRAIN
    return max(
        (
            cost.static_memory(m.role, alloc, trainable) + cost.mfc_memory(m, alloc, trainable)
            for m in mfcs
            if m.role is not None
        ),
        default=0.0,
    )


def _scored_by_mesh(
    mfcs: list[MFC], candidates: tuple[Allocation, ...], cost: CostEstimator
) -> dict[DeviceSet, list[tuple[float, float, int]]]:
    """Each candidate of one unit (its calls ``mfcs``) as (seconds of its calls alone, :func:`memory_alone`,
    its index), grouped by device mesh."""
    by_mesh: dict[DeviceSet, list[tuple[float, float, int]]] = defaultdict(list)
    for i, alloc in enumerate(candidates):
        by_mesh[alloc.mesh].append((sum(cost.mfc_time(m, alloc) for m in mfcs), memory_alone(mfcs, alloc, cost), i))
    return by_mesh


def _prune(
    names: tuple[str, ...],
    candidates: tuple[Allocation, ...],
    workflow: Workflow,
    cost: CostEstimator,
    memory_per_device: float,
    keep: set[Allocation],
) -> tuple[Allocation, ...]:
    """The candidates of a unit worth searching: per device mesh, the :data:`TOP_PER_MESH` fastest alone (the
    unit's calls' time) among those whose own memory fits a device, and the :data:`LEAN_PER_MESH` needing the
    least memory; plus ``keep`` (the start plans' allocations). A large cluster offers thousands of layouts ×
    micro-batches × recompute per train call, too many for a walk to try even once in its budget; an allocation
    slower alone than four others on the same devices rarely wins by its reallocations."""
    by_mesh = _scored_by_mesh([workflow[n] for n in names], candidates, cost)
    chosen = {i for i, alloc in enumerate(candidates) if alloc in keep}
    for scored in by_mesh.values():
        fitting = sorted((s, i) for s, need, i in scored if need <= memory_per_device)
        chosen |= {i for _, i in fitting[:TOP_PER_MESH]}
        chosen |= {i for _, _, i in sorted(scored, key=lambda t: (t[1], t[0], t[2]))[:LEAN_PER_MESH]}
    return tuple(alloc for i, alloc in enumerate(candidates) if i in chosen)


POLISH_SHARE = 0.2
"""Share of the search's time budget kept for :func:`_polish` after the annealing chains."""
POLISHED = 3
"""How many of the best distinct plans the annealing found are polished, the rest of the budget split between
them: the best one may sit in a shallower basin than the runner-up's."""


def search(
    workflow: Workflow,
    cluster: ClusterSpec,
    cost: CostEstimator,
    memory_per_device: float,
    model_configs: Mapping[str, object],
    *,
    seed: int,
    time_budget_s: float,
    chains: int = 4,
    top_k: int = 3,
    start: ExecutionPlan | list[ExecutionPlan] | None = None,
    max_steps: int | None = None,
    iterations: int = 3,
) -> list[tuple[ExecutionPlan, SimResult]]:
    """The ``top_k`` fastest distinct feasible plans found by ``chains`` annealing chains, fastest first.

    Chains start at ``start`` (default: :func:`~loomrl.plan.colocate` with pure data parallelism); given a
    list of plans (e.g. every heuristic's best), chain ``c`` starts at plan ``c``, so the chains explore from
    different strategies; chains beyond the starts begin at the best of their crossovers (:func:`_crossovers`)
    and of their interleavings (:class:`_Splitter`'s moves), all of which are simulated, then cycle through the
    starts again. Every start is itself a candidate, so
    the best plan returned is never slower than a feasible start. The chains share ``(1 - POLISH_SHARE)`` of
    ``time_budget_s`` seconds of wall clock (chain ``c`` stops at ``(c + 1) / chains`` of it), then the
    :data:`POLISHED` best plans are polished by coordinate descent (:func:`_polish`), sharing what is left of the
    budget; each chain also stops after ``max_steps`` proposals if given, and each polish then runs to its local
    optimum: when that comes
    before the deadlines, the result depends on the inputs and ``seed``, not on timing. Empty when no
    feasible plan was seen.
    """
    for name, value, low in (("chains", chains, 1), ("top_k", top_k, 1), ("max_steps", max_steps, 0)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ConfigError(f"search: {name}={value!r}; expected an integer >= {low}")
    if not time_budget_s > 0:
        raise ConfigError(f"search: time_budget_s={time_budget_s!r}; expected seconds > 0")
    began = time.monotonic()  # the budget covers pruning too (thousands of candidates priced at 64 GPUs)
    starts = start if isinstance(start, list) else [start if start is not None else colocate(workflow, cluster)]
    if not starts:
        raise ConfigError("search: start is an empty list; give at least one plan or None")
    evaluate = _Evaluator(workflow, cost, memory_per_device, iterations)
    for plan in starts:
        if evaluate(plan) is None:
            plan.validate(workflow)  # raises the one-line reason
    # each start fused or not, whichever is faster, where the estimator prices fusion: the walks then explore
    # around it (a polish toggling fusion at the end may not reach it on a large cluster's budget)
    starts = [
        min(
            [plan, *(dataclasses.replace(plan, stream_fusion=f) for f in stream_fusion_choices(plan, evaluate))],
            key=evaluate.rank,
        )
        for plan in starts
    ]
    starts = [min([plan, *filter(None, [pipeline_fusion_twin(plan, evaluate)])], key=evaluate.rank) for plan in starts]
    keep = {a for plan in starts for a in plan.allocations.values()}
    units = [
        _Unit(
            names,
            _prune(
                names,
                tuple(candidate_allocations(workflow[names[0]], workflow, cluster, model_configs)),
                workflow,
                evaluate.cost,
                memory_per_device,
                keep,
            ),
        )
        for names in unit_names(workflow)
    ]
    units = [u for u in units if len(u.candidates) > 1]
    splitter = _Splitter(units, workflow, evaluate.cost, memory_per_device)
    # chains beyond the starts start from the best of their crossovers and interleavings, not from a start
    # walked already
    known = {plan_key(p) for p in starts}
    interleaved = [m for p in starts for i, j in splitter.pairs for m in splitter.moves(p, i, j)]
    children = sorted(
        (c for c in _crossovers(starts, workflow) + interleaved if plan_key(c) not in known and evaluate(c)),
        key=evaluate.rank,
    )
    firsts = starts + children[: max(0, chains - len(starts))]
    anneal_s = time_budget_s * (1.0 - POLISH_SHARE)
    for chain in range(chains if units else 0):
        rng = random.Random(f"loomrl-search:{seed}:{chain}")
        _anneal(firsts[chain % len(firsts)], units, evaluate, rng, began + anneal_s * (chain + 1) / chains, max_steps)
    if units:  # the best plans from different regions (each chain's, roughly) settled on their local optima
        end = began + time_budget_s if max_steps is None else math.inf
        leads = [plan for plan, _ in evaluate.best(POLISHED)]
        for i, plan in enumerate(leads):
            now = time.monotonic()
            _polish(plan, units, evaluate, now + (end - now) / (len(leads) - i) if end < math.inf else end, splitter)
    return evaluate.best(top_k)


# ------------------------------------------------------------------------------------- heuristic baselines


def _symmetric_units(
    plan: ExecutionPlan, workflow: Workflow, model_configs: Mapping[str, object]
) -> list[tuple[tuple[str, ...], list[dict[str, Allocation]]]]:
    """The heuristics' layout choices: calls of one role on one mesh share one layout (the "symmetric"
    parallelisation of Megatron-based systems that ReaLHF compares with), a train layout's micro-batches
    apply to its role's pipelined inference too, and generation folds pipeline stages into data parallelism
    (the rollout engine generates with pp = 1). Returns (MFC names, the options: name → allocation each)."""
    groups: dict[tuple, list[MFC]] = {}
    for mfc in workflow.topological_order():
        if mfc.kind is not MFCKind.COMPUTE:
            groups.setdefault((mfc.role, plan[mfc.name].mesh), []).append(mfc)
    out = []
    for (_role, mesh), mfcs in groups.items():
        lead = next((m for m in mfcs if m.kind is MFCKind.TRAIN), None) or next(
            (m for m in mfcs if m.kind is MFCKind.INFERENCE), mfcs[0]
        )
        options = []
        for alloc in _allocations_on(lead, mesh, plan.cluster, model_configs):
            lay = alloc.layout
            option = {}
            for m in mfcs:
                if m.kind is MFCKind.GENERATE:
                    option[m.name] = Allocation(mesh, Layout(lay.dp * lay.pp, lay.tp))
                elif m.kind is MFCKind.TRAIN:
                    option[m.name] = alloc
                elif lay.pp > 1:
                    option[m.name] = Allocation(mesh, lay, alloc.micro_batches)
                else:
                    option[m.name] = Allocation(mesh, lay)
            options.append(option)
        out.append((tuple(m.name for m in mfcs), options))
    return out


def _per_call_units(
    plan: ExecutionPlan, workflow: Workflow, model_configs: Mapping[str, object]
) -> list[tuple[tuple[str, ...], list[dict[str, Allocation]]]]:
    """Every call (a role's train calls together) with its own layout on its mesh: reallocation between a
    role's calls lets each pick its fastest, a stronger baseline than the symmetric one."""
    out = []
    for names in unit_names(workflow):
        if workflow[names[0]].kind is MFCKind.COMPUTE:
            continue
        options = _allocations_on(workflow[names[0]], plan[names[0]].mesh, plan.cluster, model_configs)
        out.append((names, [dict.fromkeys(names, a) for a in options]))
    return out


def _best_layouts(
    plan: ExecutionPlan,
    workflow: Workflow,
    model_configs: Mapping[str, object],
    evaluate: _Evaluator,
    per_call: bool = False,
    deadline: float = math.inf,
) -> ExecutionPlan:
    """``plan`` with the fastest layouts (and micro-batches) of its model calls on the meshes it chose:
    symmetric (:func:`_symmetric_units`) or, with ``per_call``, one layout per call (:func:`_per_call_units`).

    Exhaustive up to :data:`ENUMERATION_LIMIT` combinations; beyond, coordinate-wise: each unit in turn takes
    its best layout with the others fixed, sweeping until a sweep changes nothing (at most ``_MAX_SWEEPS``).
    Past ``deadline`` (``time.monotonic()``) it returns the best it has simulated (the first option of each
    unit at least).
    """
    units = (_per_call_units if per_call else _symmetric_units)(plan, workflow, model_configs)
    # leanest first: when a deadline cuts the enumeration short, what was tried is likely to fit
    choices = [
        sorted(options, key=lambda option: _option_memory(option, workflow, evaluate.cost)) for _, options in units
    ]
    if math.prod(len(c) for c in choices) <= ENUMERATION_LIMIT:
        combos = (_assign(plan, combo) for combo in itertools.product(*choices))
        return min(_until(combos, deadline), key=evaluate.rank)
    best = plan
    for _ in range(_MAX_SWEEPS):
        before = plan_key(best)
        for options in choices:
            best = min(_until((_assign(best, (option,)) for option in options), deadline), key=evaluate.rank)
        if plan_key(best) == before or time.monotonic() > deadline:
            break
    return best


def _option_memory(option: Mapping[str, Allocation], workflow: Workflow, cost: CostEstimator) -> float:
    """The most bytes per device one call of a layout option needs alone (:func:`memory_alone`)."""
    return max(memory_alone([workflow[name]], alloc, cost) for name, alloc in option.items())


def _until(plans, deadline: float):
    """``plans`` until ``deadline`` passes, the first always (a minimum needs one)."""
    for i, plan in enumerate(plans):
        if i and time.monotonic() > deadline:
            return
        yield plan


def _assign(plan: ExecutionPlan, combo: tuple[dict[str, Allocation], ...]) -> ExecutionPlan:
    chosen = {n: a for option in combo for n, a in option.items()}
    return dataclasses.replace(plan, allocations={n: chosen.get(n, a) for n, a in plan.allocations.items()})


def _generation_devices(cluster: ClusterSpec) -> list[int]:
    """Generation device counts :func:`best_heuristic_plans` tries for separate: powers of two, whole nodes,
    and half the cluster (the strategy's default), which comes first."""
    n, per_node = cluster.n_devices, cluster.devices_per_node
    counts = {g for g in range(1, n) if g & (g - 1) == 0 or g % per_node == 0} | {n // 2}
    # half the cluster (the strategy's default) first: what a deadline leaves time for
    return sorted((c for c in counts if 1 <= c < n), key=lambda c: (c != n // 2, c))


def best_heuristic_plans(
    workflow: Workflow,
    cluster: ClusterSpec,
    cost: CostEstimator,
    memory_per_device: float,
    model_configs: Mapping[str, object],
    *,
    iterations: int = 3,
    per_call: bool = False,
    deadline: float = math.inf,
) -> dict[str, tuple[ExecutionPlan, SimResult]]:
    """Strategy name (``colocate``, ``interleave``, ``separate``) → its fastest feasible plan and simulation.

    Each strategy keeps its meshes and gets its best layouts by enumeration (see :func:`_best_layouts`):
    one layout per role and mesh, or with ``per_call`` one per call; interleave also tries both of its
    device splits (power-of-two and proportional ranges);
    separate also tries each count of :func:`_generation_devices`. Where reloading an offloaded role costs time,
    each tuned plan is also tried with every frozen role resident. A strategy with no feasible plan maps to
    its least infeasible one (``feasible=False`` and the reason); ``separate`` is absent on one device.
    ``deadline`` (``time.monotonic()``) is shared by the strategies in turn: each gets an equal part of what is
    left, and past its part keeps the best layouts simulated so far.
    """
    evaluate = _Evaluator(workflow, cost, memory_per_device, iterations)
    pow2 = cluster.n_devices & (cluster.n_devices - 1) == 0
    splits = ("pow2", "proportional") if pow2 else ("proportional",)  # shardable vs balanced ranges
    starts = {
        "colocate": [colocate(workflow, cluster)],
        "interleave": [interleave(workflow, cluster, model_configs, split) for split in splits],
    }
    if cluster.n_devices > 1:
        starts["separate"] = [separate(workflow, cluster, g) for g in _generation_devices(cluster)]
    out: dict[str, tuple[ExecutionPlan, SimResult]] = {}
    for k, (name, plans) in enumerate(starts.items()):
        now = time.monotonic()
        part = now + (deadline - now) / (len(starts) - k) if deadline < math.inf else math.inf
        tuned: list[ExecutionPlan] = []
        for i, p in enumerate(plans):  # the first of a strategy's plans always, the others while time is left
            if tuned and time.monotonic() > part:
                break
            tuned.append(
                _best_layouts(
                    p,
                    workflow,
                    model_configs,
                    evaluate,
                    per_call,
                    now + (part - now) * (i + 1) / len(plans) if part < math.inf else math.inf,
                )
            )
        # each tuned plan also with every frozen role resident (no reload before its calls), where it fits
        tuned += [
            ExecutionPlan(p.cluster, p.allocations, p.shadow, ())
            for p in tuned
            if _offload_choices(p, evaluate, trained=False) and p.offloaded_roles(workflow)
        ]
        best = min(tuned, key=evaluate.rank)
        result = evaluate(best)
        if result is None:  # a strategy's own plan is always structurally valid; guard the invariant
            best.validate(workflow)
        assert result is not None  # evaluate gives None only for a plan validate refuses, raising above
        out[name] = (best, result)
    return out
