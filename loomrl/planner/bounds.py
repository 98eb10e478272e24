"""A lower bound on the iteration time of every plan the search can build, from the cost model alone.

Two facts hold for every plan in the search's space (:func:`~loomrl.planner.search.candidate_allocations`),
whatever its reallocations, reloads and scheduling add (they only add):

- **Work**: a call occupies every device of its mesh for its whole time, so one iteration takes at least
  ``Σ seconds × mesh size`` over the calls, divided by the cluster's device count.
- **Dependencies**: each parameter-version edge of the unrolled workflow (a trained role's first call of
  iteration ``i + 1`` waits for its last call of iteration ``i``) closes a cycle with any path of data edges
  between those calls, and the calls of such a cycle run one after another once per iteration.

Fast calls on many devices are cheap in time and dear in device-seconds (generation's decode reads the weights
once per replica and step), so neither fact alone is tight. For a cycle ``P`` and a weight ``λ`` in [0, 1],
``T ≥ λ · Σ_P seconds + (1 − λ) · work / devices`` holds for the plan's own allocations, hence for the
allocations minimizing the right-hand side, which splits into one small minimum per call (a role's train calls
share one allocation and are taken together). The bound is the largest such value over the cycles and a grid
of ``λ``: ``λ = 0`` is the work bound with each call at its most frugal allocation, ``λ = 1`` the longest
cycle with each call at its fastest. Only allocations that can fit count: the call's own memory (resident
state plus its transient memory) on each device of its mesh, plus the share of the trained roles' resident
training state (at its smallest over their train allocations) that the devices outside the mesh cannot hold.
The figure goes through the estimator's whole-iteration correction like the simulator's.

The simulator runs iterations one after another, as the runtime's trainer does, so each simulated iteration
holds all of its calls' work and runs its cycles' calls one after another: no simulated time is below the
bound. Its use: a heuristic plan within a factor ``f`` of the bound leaves no plan of the space more than ``f``
faster, whatever the search does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from loomrl.plan import ClusterSpec
from loomrl.planner.search import candidate_allocations, memory_alone, unit_names
from loomrl.planner.simulator import CostEstimator
from loomrl.workflow import MFCKind, Workflow

__all__ = ["IterationBound", "iteration_bound"]

LAMBDAS = 200
"""Steps of the grid of weights between the cycle and the work bound."""


@dataclass(frozen=True)
class IterationBound:
    """A lower bound on seconds per iteration (see the module docstring)."""

    seconds: float
    """The bound, with the estimator's whole-iteration correction (inf: some call fits no device on its own)."""
    work: float
    """The work bound alone (λ = 0): least device-seconds of one iteration over the device count."""
    cycle: float
    """The dependency bound alone (λ = 1): the longest cycle with every call at its fastest."""
    weight: float
    """The ``λ`` that gave the bound."""
    path: tuple[str, ...]
    """The calls of the cycle that gave it, in order."""

    @property
    def limit(self) -> str:
        """What binds: ``"work"`` (weight 0), ``"cycle"`` (weight 1) or ``"both"``."""
        return {0.0: "work", 1.0: "cycle"}.get(self.weight, "both")


def iteration_bound(workflow: Workflow, cluster: ClusterSpec, cost: CostEstimator, memory_per_device: float,
                    model_configs: Mapping[str, object]) -> IterationBound:
    """The lower bound on any searched plan's iteration time for ``workflow`` on ``cluster`` (module docstring)."""
    states = _training_states(workflow, cluster, cost, memory_per_device, model_configs)
    options = {names: _options(names, workflow, cluster, cost, memory_per_device, model_configs, states)
               for names in unit_names(workflow)}
    if not all(options.values()):  # some call fits nowhere: no plan of the space fits
        return IterationBound(math.inf, math.inf, math.inf, 0.0, ())
    n = cluster.n_devices

    def bound(weight: float, path: tuple[str, ...]) -> float:
        return sum(min(weight * sum(t for name, t in zip(names, times) if name in path)
                       + (1.0 - weight) * sum(times) * size / n for times, size in opts)
                   for names, opts in options.items())

    cycles = _cycles(workflow)
    value, weight, path = max(((bound(step / LAMBDAS, path), step / LAMBDAS, path)
                               for path in cycles for step in range(LAMBDAS + 1)), key=lambda t: t[0])
    corrected = getattr(cost, "iteration_time", None)
    seconds = corrected(value) if corrected is not None else value
    return IterationBound(seconds, bound(0.0, ()), max(bound(1.0, path) for path in cycles), weight, path)


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


def _cycles(workflow: Workflow) -> list[tuple[str, ...]]:
    """Every path of data edges from a trained role's first call to its last call of the same iteration (the
    cycle the version edge between them closes), as the calls in order; one-call paths included."""
    successors: dict[str, list[str]] = {m.name: [] for m in workflow}
    for m in workflow:
        for d in workflow.deps(m.name):
            successors[d].append(m.name)
    edges = {(last, mfc.name) for it, mfc, deps in workflow.unroll(2) if it == 1 for i, last in deps if i == 0}
    paths: list[tuple[str, ...]] = []

    def walk(path: tuple[str, ...], goal: str) -> None:
        if path[-1] == goal:
            paths.append(path)
            return
        for nxt in successors[path[-1]]:
            walk(path + (nxt,), goal)

    for last, first in sorted(edges):
        walk((first,), last)
    return paths or [()]
