"""The placement strategies' best plans, the baselines every search is reported beside.

:func:`best_heuristic_plans`: colocate, interleave and separate, each with its best layouts on the meshes the
strategy chose (and, for separate, the best number of generation devices), so the search's gain over them is
always visible. A heuristic's layouts are symmetric: every call of a role on a mesh uses the same one, as in the
Megatron-based systems ReaLHF compares with (``per_call=True`` gives each call its own, a stronger baseline that
already uses reallocation).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Mapping

from loomrl.plan import Allocation, ClusterSpec, ExecutionPlan, colocate, interleave, separate
from loomrl.plan.layout import Layout
from loomrl.planner.cost.estimator import CostEstimator
from loomrl.planner.search.candidates import allocations_on, memory_alone, unit_names
from loomrl.planner.search.evaluate import Evaluator, offload_choices, plan_key
from loomrl.planner.simulation.simulator import SimResult
from loomrl.workflow import MFC, MFCKind, Workflow

__all__ = ["ENUMERATION_LIMIT", "best_heuristic_plans"]


ENUMERATION_LIMIT = 256
"""A heuristic plan's layout combinations are enumerated exhaustively up to this many, else coordinate-wise."""


_MAX_SWEEPS = 6
"""Coordinate-wise sweeps :func:`_best_layouts` makes at most (each sweep that changes nothing ends it)."""


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
        for alloc in allocations_on(lead, mesh, plan.cluster, model_configs):
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
        options = allocations_on(workflow[names[0]], plan[names[0]].mesh, plan.cluster, model_configs)
        out.append((names, [dict.fromkeys(names, a) for a in options]))
    return out


def _best_layouts(
    plan: ExecutionPlan,
    workflow: Workflow,
    model_configs: Mapping[str, object],
    evaluate: Evaluator,
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
    evaluate = Evaluator(workflow, cost, memory_per_device, iterations)
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
            if offload_choices(p, evaluate, trained=False) and p.offloaded_roles(workflow)
        ]
        best = min(tuned, key=evaluate.rank)
        result = evaluate(best)
        if result is None:  # a strategy's own plan is always structurally valid; guard the invariant
            best.validate(workflow)
        assert result is not None  # evaluate gives None only for a plan validate refuses, raising above
        out[name] = (best, result)
    return out
