"""Pricing plans for the search and the heuristics: each distinct plan simulated once (:class:`Evaluator`), the
cost estimator asked once per distinct question (:class:`CachedCost`), and a plan's identity (:func:`plan_key`).
"""

from __future__ import annotations

import math

from loomrl.errors import ConfigError
from loomrl.plan import Allocation, ExecutionPlan
from loomrl.plan.schedule import Step
from loomrl.planner.cost.estimator import CostEstimator
from loomrl.planner.cost.stream_fusion import GenerationFloor, Part
from loomrl.planner.simulation.simulator import SimResult, simulate
from loomrl.workflow import MFC, Workflow

__all__ = ["CachedCost", "Evaluator", "PlanKey", "offload_choices", "plan_key"]


PlanKey = tuple


def plan_key(plan: ExecutionPlan) -> PlanKey:
    """A hashable identity of a plan: its allocations' texts by MFC name, its shadow and offload choices, its
    fusions and its staleness."""
    choices = tuple((chosen is not None, chosen or ()) for chosen in (plan.shadow, plan.offload))  # None: default
    fusion = (
        "" if plan.stream_fusion is None else plan.stream_fusion.text
    )  # a string either way: keys are compared on ties
    return (
        tuple(sorted((n, a.text) for n, a in plan.allocations.items())),
        *choices,
        fusion,
        plan.pipeline_fusion,
        plan.staleness,
    )


class Evaluator:
    """Simulates each distinct plan once; wraps the cost estimator in a cache shared by all plans."""

    def __init__(self, workflow: Workflow, cost: CostEstimator, memory_per_device: float, iterations: int) -> None:
        self.workflow, self.cost = workflow, cost if isinstance(cost, CachedCost) else CachedCost(cost)
        self.memory, self.iterations = memory_per_device, iterations
        self.results: dict[PlanKey, tuple[ExecutionPlan, SimResult | None]] = {}

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

    def best_of(self, keep) -> tuple[ExecutionPlan, SimResult] | None:
        """The fastest feasible plan simulated so far for which ``keep(plan)`` holds (ties as :meth:`best`)."""
        found = [
            ((r.iteration_time, r.device_seconds, key), plan, r)
            for key, (plan, r) in self.results.items()
            if r is not None and r.feasible and keep(plan)
        ]
        return min(found, key=lambda item: item[0])[1:] if found else None

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

    def copy_keeps_base(self, role: str) -> bool:
        return self.inner.copy_keeps_base(role)

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


def offload_choices(plan: ExecutionPlan, evaluate: Evaluator, trained: bool = True) -> list[str]:
    """Roles the search may offload or keep resident, when the estimator prices reloading them (without a price,
    offloading only saves memory, so the default rule's choice is never worse) and the devices offload at all
    (CPU devices do not: the choice would change nothing): those without a train call, and with ``trained``
    the trained ones too, whose state then sleeps through the generations on their devices."""
    if not evaluate.cost.offloads():
        return []
    frozen = set(evaluate.workflow.roles()) - set(plan.trained_roles(evaluate.workflow))
    return [role for role in evaluate.workflow.roles() if trained or role in frozen]
