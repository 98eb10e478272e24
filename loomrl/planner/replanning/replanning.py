"""Re-planning a run in progress (dynamic placement): the cost model refitted from the run's own calls, the
workload it observes now, candidate plans for it, and the price of switching to one.

A run hands over its iterations as :class:`Observed` records (the plan that ran, the iteration's metrics, and
whether it was that plan's first iteration, whose one-off costs are left out of fits). :func:`refit` fits the
cost model's corrections as ``loomrl calibrate --from`` fits finished runs: per-call observations from each
iteration's ``time/<mfc>_s`` and length statistics
(:func:`~loomrl.planner.calibration.traces.observations_from_metrics`),
priced with the uncorrected model, then the whole-iteration line
(:func:`~loomrl.planner.calibration.runs.fit_observations`); what the run has not measured keeps the given
corrections (``runtime.cost_corrections``). :func:`search_candidates` finds plans for the observed workload (each
heuristic's best layouts and a short annealing search, within a time budget); :func:`price_plans` simulates
them; :func:`switch_seconds` prices a switch from the moves that make it
(:func:`loomrl.runtime.plan_change.plan_moves` says which) and the new schedule's prologue.

**Only what was measured.** The analytic terms are far from a real run until corrections scale them: on this
project's CPU machine, a model whose corrections came from a run's training calls alone (its generation and
scoring ran fused, traced as one step) priced a plan with tensor-parallel generation and fused pipelined
training 1.4x faster than the run's plan, and it ran 2.7x slower. A candidate is therefore a plan whose every
call uses only cost term groups the corrections were fitted for or given (:func:`calibrated`: a call kind's
roofline and launches; tensor-parallel or FSDP launches only once measured), and no fusion: a fused stage or
fused training step is traced as one step, from which no call's correction can be fitted. The search is steered
the same way (:class:`TrustedCost`). The plan in force is always priced, whatever it is.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from loomrl.plan import Allocation, ExecutionPlan
from loomrl.plan.schedule import Step
from loomrl.planner.calibration.runs import fit_observations
from loomrl.planner.calibration.traces import observations_from_metrics, trace_predictor
from loomrl.planner.cost.corrections import Corrections, group_sums
from loomrl.planner.cost.estimator import CostEstimator
from loomrl.planner.cost.model import CostModel
from loomrl.planner.cost.workload import Workload, lengths_from_summary
from loomrl.planner.inputs import PlannerInputs
from loomrl.planner.search.evaluate import CachedCost, plan_key
from loomrl.planner.search.heuristics import best_heuristic_plans
from loomrl.planner.search.search import search
from loomrl.planner.simulation.simulator import simulate
from loomrl.workflow import MFC, MFCKind, Workflow

__all__ = ["Observed", "TrustedCost", "calibrated", "price_plans", "refit", "search_candidates", "switch_seconds"]

STATE_BYTES = {"master": 4, "exp_avg": 4, "exp_avg_sq": 4}
"""Bytes per parameter of each kind of training state a move carries besides the weights (fp32)."""
SEARCH_CHAINS = 2
"""Annealing chains of a re-plan: its budget is a few seconds, too short to share among more."""
UNTRUSTED = 10.0
"""How much slower :class:`TrustedCost` prices a call using term groups no correction was fitted for, so the search
walks away from it (an infinite price would stop the simulator)."""


@dataclass(frozen=True)
class Observed:
    """One finished iteration of the run."""

    iteration: int
    plan: ExecutionPlan
    metrics: Mapping[str, float]
    """Its metrics: ``time/<mfc>_s``, ``time/iteration_s``, the response and prompt length statistics."""
    first: bool
    """The plan's first iteration (the run's, or the one after a switch): its one-off costs are not fitted."""


def _record_workload(inputs: PlannerInputs, metrics: Mapping[str, float]) -> Workload:
    """An iteration's workload from its length statistics (as a finished run's is rebuilt)."""
    lengths = lengths_from_summary(
        metrics["response/length"], metrics["response/length_p90"], metrics["response/length_max"]
    )
    return inputs.workload_of(lengths, metrics.get("prompt/length", 0.0), metrics)


def refit(
    inputs: PlannerInputs,
    records: Sequence[Observed],
    prior: Corrections | None = None,
    observed: dict[int, list[dict]] | None = None,
) -> Corrections | None:
    """Corrections fitted over the run's iterations but each plan's first, over ``prior`` (which keeps what they
    do not measure); ``prior`` alone while there are none. ``observed`` keeps each iteration's calls as
    observations with their uncorrected terms across refits (they never change: priced once), and drops those of
    iterations no longer in ``records``."""
    observed = {} if observed is None else observed
    kept = [r for r in records if not r.first]
    predict = trace_predictor(
        inputs.cluster, inputs.profile, inputs.shapes, bytes_per_param=inputs.bytes_per_param, settings=inputs.settings
    )
    workload = inputs.workload
    observations = []
    for r in kept:
        if r.iteration not in observed:
            found = observations_from_metrics(
                [r.metrics],
                r.plan,
                inputs.workflow,
                workload.batch,
                r.metrics.get("prompt/length", 0.0),
                skip_first=False,
                samples_per_prompt=workload.samples_per_prompt,
            )
            observed[r.iteration] = [{**o, "predicted_terms": predict(o)} for o in found]
        observations += observed[r.iteration]
    for gone in set(observed) - {r.iteration for r in records}:
        del observed[gone]
    if not observations:
        return prior
    memory = inputs.memory_per_device

    def simulated(calls: Corrections) -> list[float]:
        return [
            simulate(
                r.plan,
                inputs.workflow,
                inputs.cost_model(_record_workload(inputs, r.metrics), calls),
                memory,
                iterations=2,
            ).iteration_time
            for r in kept
        ]

    fitted = fit_observations(observations, simulated, [r.metrics["time/iteration_s"] for r in kept])
    if prior is None:
        return fitted
    return Corrections(
        {**prior.scale, **fitted.scale},
        {**prior.overhead_s, **fitted.overhead_s},
        {**prior.observations, **fitted.observations},
    )


def calibrated(mfc: MFC, alloc: Allocation, cost: CostModel) -> bool:
    """Whether every term group of the call (:func:`~loomrl.planner.cost.corrections.term_group`) has a fitted or given
    correction for its kind; a call with no terms (a rule reward) needs its kind's fitted overhead."""
    corrections, kind = cost.corrections, mfc.kind.value
    used = [group for group, seconds in group_sums(cost.time_terms(mfc, alloc)).items() if seconds > 0]
    if not used:
        return kind in corrections.overhead_s
    return all((kind if group == "roofline" else f"{kind}.{group}") in corrections.scale for group in used)


def trusted(plan: ExecutionPlan, workflow: Workflow, cost: CostModel) -> bool:
    """A candidate the run's corrections can price: unfused, and every call :func:`calibrated`."""
    return (
        plan.stream_fusion is None
        and not plan.pipeline_fusion
        and all(calibrated(mfc, plan[mfc.name], cost) for mfc in workflow.topological_order())
    )


class TrustedCost(CostEstimator):
    """``cost`` as the re-planner's search sees it: a call that is not :func:`calibrated` priced :data:`UNTRUSTED`
    times slower, and fusion not priced (the estimator's defaults: a fused stage runs its calls in turn, so the
    search does not fuse)."""

    def __init__(self, cost: CostModel):
        self.cost = cost

    def mfc_time(self, mfc: MFC, alloc: Allocation) -> float:
        seconds = self.cost.mfc_time(mfc, alloc)
        return seconds if calibrated(mfc, alloc, self.cost) else UNTRUSTED * seconds

    def mfc_memory(self, mfc: MFC, alloc: Allocation, trainable: bool) -> float:
        return self.cost.mfc_memory(mfc, alloc, trainable)

    def static_memory(self, role: str, alloc: Allocation, trainable: bool) -> float:
        return self.cost.static_memory(role, alloc, trainable)

    def realloc_time(self, role: str, src: Allocation, dst: Allocation) -> float:
        return self.cost.realloc_time(role, src, dst)

    def reload_time(self, role: str, alloc: Allocation, trainable: bool = False) -> float:
        return self.cost.reload_time(role, alloc, trainable)

    def offload_time(self, role: str, alloc: Allocation, trainable: bool = False) -> float:
        return self.cost.offload_time(role, alloc, trainable)

    def offloads(self) -> bool:
        return self.cost.offloads()

    def copy_keeps_base(self, role: str) -> bool:
        return self.cost.copy_keeps_base(role)

    def shared_cores(self) -> float | None:
        return self.cost.shared_cores()

    def iteration_time(self, simulated_s: float) -> float:
        return self.cost.iteration_time(simulated_s)


def price_plans(plans: Sequence[ExecutionPlan], workflow: Workflow, cost: CostModel) -> list[float]:
    """Each plan's predicted seconds per iteration (``inf`` where it does not fit in memory)."""
    memory = cost.profile.memory_bytes
    cached = CachedCost(cost)
    out = []
    for plan in plans:
        result = simulate(plan, workflow, cached, memory, iterations=2)
        out.append(result.iteration_time if result.feasible else float("inf"))
    return out


def search_candidates(
    inputs: PlannerInputs, cost: CostModel, current: ExecutionPlan, budget_s: float, seed: int = 0
) -> list[ExecutionPlan]:
    """Candidate plans for ``cost``'s workload: each heuristic strategy's best layouts (within half of
    ``budget_s``) and the best plans of a short annealing search started from them and from ``current`` unfused
    (the rest), all searched on :class:`TrustedCost`; distinct, and only those :func:`trusted`."""
    began = time.monotonic()
    steered = CachedCost(TrustedCost(cost))
    memory = cost.profile.memory_bytes
    heuristics = best_heuristic_plans(
        inputs.workflow, inputs.cluster, steered, memory, inputs.configs, iterations=2, deadline=began + budget_s / 2
    )
    starts = [unfused(current, inputs.workflow)] + [plan for plan, result in heuristics.values() if result.feasible]
    left = max(budget_s - (time.monotonic() - began), 0.1 * budget_s)
    found = search(
        inputs.workflow,
        inputs.cluster,
        steered,
        memory,
        inputs.configs,
        seed=seed,
        time_budget_s=left,
        chains=SEARCH_CHAINS,
        start=starts,
        iterations=2,
    )
    plans: dict = {}
    for plan in [*starts, *(plan for plan, _ in found)]:
        plans.setdefault(plan_key(plan), plan)
    return [plan for plan in plans.values() if trusted(plan, inputs.workflow, cost)]


def unfused(plan: ExecutionPlan, workflow: Workflow) -> ExecutionPlan:
    """``plan`` without inter-stage fusion, and with its train calls unfused (their own stage order back)."""
    if plan.pipeline_fusion:
        plan = dataclasses.replace(
            plan,
            allocations={
                name: dataclasses.replace(alloc, layout=dataclasses.replace(alloc.layout, reverse=False))
                if workflow[name].kind is MFCKind.TRAIN
                else alloc
                for name, alloc in plan.allocations.items()
            },
        )
    return dataclasses.replace(plan, stream_fusion=None, pipeline_fusion=False)


def switch_seconds(cost: CostModel, moves: Sequence, prologue: Sequence[Step]) -> float:
    """Priced seconds of a switch: every move (an object with ``role``, ``src``, ``dst`` and ``kinds``, as
    :class:`loomrl.runtime.plan_change.Move`) priced as a reallocation of the role's weights scaled by the bytes
    of what it carries (fp32 master weights and Adam's moments besides the weights), then the new schedule's
    prologue (its shadows filled), one after the other."""
    seconds = 0.0
    weight_bytes = cost.bytes_per_param
    for move in moves:
        carried = sum(STATE_BYTES.get(kind, weight_bytes) for kind in move.kinds)
        seconds += cost.realloc_time(move.role, move.src, move.dst) * carried / weight_bytes
    for step in prologue:
        transfer = step.transfer  # a shadow fill: a copy or sync
        if transfer is not None:
            seconds += cost.realloc_time(*transfer)
    return seconds
