"""Plan search: simulated annealing over one candidate allocation per call (:mod:`~loomrl.planner.search.candidates`),
started from the heuristics' best plans (:mod:`~loomrl.planner.search.heuristics`).

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
from collections.abc import Mapping

from loomrl.errors import ConfigError
from loomrl.plan import Allocation, ClusterSpec, DeviceSet, ExecutionPlan, colocate
from loomrl.plan.plan import AsyncTraining, StreamFusion
from loomrl.planner.cost.estimator import CostEstimator
from loomrl.planner.cost.pipeline_fusion import can_pipeline_fuse
from loomrl.planner.search.candidates import Unit, candidate_allocations, scored_by_mesh, unit_names
from loomrl.planner.search.evaluate import Evaluator, offload_choices, plan_key
from loomrl.planner.simulation.simulator import SimResult
from loomrl.workflow import MFCKind, Workflow

__all__ = [
    "POLISHED",
    "POLISH_SHARE",
    "async_choices",
    "pipeline_fusion_twin",
    "search",
    "stream_fusion_choices",
    "with_async",
]


TOP_PER_MESH = 4
"""Allocations a unit keeps per device mesh in the search: its fastest alone among those that fit the devices
alone (as ReaLHF keeps a few best parallel strategies per mesh), see :func:`_prune`."""


LEAN_PER_MESH = 2
"""More allocations kept per mesh: those needing the least memory, so tight setups can still be fitted."""


def _move(plan: ExecutionPlan, unit: Unit, rng: random.Random) -> dict[str, Allocation]:
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

    def __init__(self, units: list[Unit], workflow: Workflow, cost: CostEstimator, memory_per_device: float):
        self.units = units
        self.pairs = [
            (i, j)
            for i, j in itertools.combinations(range(len(units)), 2)
            if all(workflow.independent(a, b) for a in units[i].names for b in units[j].names)
        ]
        self.fastest: dict[tuple[int, DeviceSet], Allocation] = {}
        for k, unit in enumerate(units):
            by_mesh = scored_by_mesh([workflow[n] for n in unit.names], unit.candidates, cost)
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


def _propose(plan: ExecutionPlan, units: list[Unit], rng: random.Random) -> ExecutionPlan:
    """One MFC group moved to another candidate, or, a quarter of the time, two groups at once: moving two
    calls side by side is often worse one at a time than together. The plan's offload choice is kept (the
    polish settles it: it hardly interacts with the layouts, and random switches would spend the walk's
    steps)."""
    count = 2 if len(units) > 1 and rng.random() < 0.25 else 1
    changes: dict[str, Allocation] = {}
    for index in rng.sample(range(len(units)), count):
        changes |= _move(plan, units[index], rng)
    return _with(plan, changes)


def _toggle_offload(plan: ExecutionPlan, workflow: Workflow, role: str) -> ExecutionPlan:
    """``plan`` with ``role`` offloaded between its calls if it was not, resident if it was (the offloaded
    set made explicit, in workflow order)."""
    offloaded = set(plan.offloaded_roles(workflow)) ^ {role}
    return dataclasses.replace(plan, offload=tuple(r for r in workflow.roles() if r in offloaded))


def stream_fusion_choices(plan: ExecutionPlan, evaluate: Evaluator) -> list[StreamFusion | None]:
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


def async_choices(plan: ExecutionPlan, evaluate: Evaluator, max_staleness: int) -> list[AsyncTraining | None]:
    """The staleness settings the search tries on ``plan`` (the current one left out) under the user's bound
    ``max_staleness``: synchronous, asynchronous at staleness 1 and, from a bound of 2, partial rollouts at
    staleness 2. With the interleaving an asynchronous plan fixes, each iteration overlaps one batch's generation
    with another's training whatever the staleness, so a larger one is no faster in the simulator's steady state
    (identical iterations) and only costs the learning: the least staleness that overlaps is the one to choose.
    Partial rollouts need 2, and spread each batch's tail over two iterations (a single-turn rollout only). None
    without a bound or rollout generation."""
    rollouts = evaluate.workflow.rollout_generations()
    if max_staleness < 1 or not rollouts:
        return []
    options: list[AsyncTraining | None] = [None, AsyncTraining(1)]
    if max_staleness >= 2 and len(rollouts) == 1 and not rollouts[0].multi_turn:
        options.append(AsyncTraining(2, partial_rollout=True))
    return [a for a in options if a != plan.asynchronous]


def with_async(plan: ExecutionPlan, setting: AsyncTraining | None) -> ExecutionPlan:
    """``plan`` with staleness ``setting`` (asynchronous training excludes stream fusion: it is dropped)."""
    fusion = plan.stream_fusion if setting is None else None
    return dataclasses.replace(plan, asynchronous=setting, stream_fusion=fusion)


def pipeline_fusion_twin(plan: ExecutionPlan, evaluate: Evaluator) -> ExecutionPlan | None:
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
    units: list[Unit],
    evaluate: Evaluator,
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
    best: ExecutionPlan,
    units: list[Unit],
    evaluate: Evaluator,
    deadline: float,
    splitter: _Splitter | None = None,
    max_staleness: int = 0,
) -> None:
    """Coordinate descent from ``best``: generation fused with the inference that reads it or not
    (:func:`stream_fusion_choices`), synchronous or asynchronous up to ``max_staleness`` (:func:`async_choices`),
    then each unit in turn takes its best candidate with the others fixed, then each
    pair of independent units tries the halves of either one's mesh (``splitter``), then each frozen role
    offloaded or resident, sweeping until a sweep improves nothing or the deadline passes (results land in
    ``evaluate``). Annealing finds the region; this settles it on the local optimum, which random proposals
    reach only by luck."""
    current, rank = best, evaluate.rank(best)
    group = evaluate.workflow.stream_fusable()
    generating = group[0].name if group is not None else None
    rollouts = {m.name for m in evaluate.workflow.rollout_generations()}

    def trials():  # each built from the plan current when it is drawn
        for fusion in stream_fusion_choices(current, evaluate):  # fused or not: cheap to try, and it moves a lot
            yield dataclasses.replace(current, stream_fusion=fusion)
        for setting in async_choices(current, evaluate, max_staleness):
            yield with_async(current, setting)
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
                if rollouts & set(unit.names):  # or only asynchronous (or only synchronous)
                    for setting in async_choices(trial, evaluate, max_staleness):
                        yield with_async(trial, setting)
        if splitter is not None:
            for i, j in splitter.pairs:
                yield from splitter.moves(current, i, j)
        for role in offload_choices(current, evaluate):  # offloaded or resident
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


def _best_variant(plan: ExecutionPlan, evaluate: Evaluator, max_staleness: int) -> ExecutionPlan:
    """``plan`` stream-fused or not, then pipeline-fused or not, then asynchronous or not, each whichever is
    faster, where the estimator prices it: the walks then explore around it (a polish toggling these at the end
    may not reach it on a large cluster's budget)."""
    plan = min(
        [plan, *(dataclasses.replace(plan, stream_fusion=f) for f in stream_fusion_choices(plan, evaluate))],
        key=evaluate.rank,
    )
    plan = min([plan, *filter(None, [pipeline_fusion_twin(plan, evaluate)])], key=evaluate.rank)
    return min([plan, *(with_async(plan, a) for a in async_choices(plan, evaluate, max_staleness))], key=evaluate.rank)


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
    by_mesh = scored_by_mesh([workflow[n] for n in names], candidates, cost)
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


def _check_budget(chains: int, top_k: int, max_steps: int | None, time_budget_s: float) -> None:
    """One-line errors for a search's budget arguments."""
    for name, value, low in (("chains", chains, 1), ("top_k", top_k, 1), ("max_steps", max_steps, 0)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ConfigError(f"search: {name}={value!r}; expected an integer >= {low}")
    if not time_budget_s > 0:
        raise ConfigError(f"search: time_budget_s={time_budget_s!r}; expected seconds > 0")


def _units(
    workflow: Workflow,
    cluster: ClusterSpec,
    model_configs: Mapping[str, object],
    cost: CostEstimator,
    memory_per_device: float,
    keep: set[Allocation],
) -> list[Unit]:
    """The units the search moves, each with its pruned candidate allocations (``keep``: the starts', never
    pruned); a unit with a single candidate has nothing to choose and is left out."""
    units = [
        Unit(
            names,
            _prune(
                names,
                tuple(candidate_allocations(workflow[names[0]], workflow, cluster, model_configs)),
                workflow,
                cost,
                memory_per_device,
                keep,
            ),
        )
        for names in unit_names(workflow)
    ]
    return [u for u in units if len(u.candidates) > 1]


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
    max_staleness: int = 0,
    evaluator: Evaluator | None = None,
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

    ``max_staleness`` (the user's bound; 0: synchronous plans only) lets plans train asynchronously
    (:func:`async_choices`). ``evaluator`` (made here by default) keeps every plan simulated, for the caller.
    """
    _check_budget(chains, top_k, max_steps, time_budget_s)
    began = time.monotonic()  # the budget covers pruning too (thousands of candidates priced at 64 GPUs)
    starts = start if isinstance(start, list) else [start if start is not None else colocate(workflow, cluster)]
    if not starts:
        raise ConfigError("search: start is an empty list; give at least one plan or None")
    evaluate = evaluator if evaluator is not None else Evaluator(workflow, cost, memory_per_device, iterations)
    for plan in starts:
        if evaluate(plan) is None:
            plan.validate(workflow)  # raises the one-line reason
    starts = [_best_variant(plan, evaluate, max_staleness) for plan in starts]
    keep = {a for plan in starts for a in plan.allocations.values()}
    units = _units(workflow, cluster, model_configs, evaluate.cost, memory_per_device, keep)
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
            until = now + (end - now) / (len(leads) - i) if end < math.inf else end
            _polish(plan, units, evaluate, until, splitter, max_staleness)
    return evaluate.best(top_k)
