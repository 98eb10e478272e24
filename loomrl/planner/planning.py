"""`loomrl plan`: compare the heuristic placements with a searched plan for a workload on a cluster.

Every strategy (colocate, interleave, separate) gets its best layouts by enumeration, so the comparison with the
search is fair; the searched plan is always printed next to them. Models are given by HF-style configs: the
zoo's, a checkpoint's, or the published architectures of :mod:`loomrl.models.presets`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from loomrl.plan import ExecutionPlan
from loomrl.planner.inputs import PlannerInputs
from loomrl.planner.search.bounds import IterationBound, iteration_bound
from loomrl.planner.search.evaluate import CachedCost, Evaluator, plan_key
from loomrl.planner.search.heuristics import best_heuristic_plans
from loomrl.planner.search.search import search
from loomrl.planner.simulation.simulator import SimResult
from loomrl.workflow import Workflow

SEARCH_CHAINS = 8
"""Annealing chains of :func:`compare_plans`: one from each heuristic's best plan, the rest from the best
crossovers of them. In the plan_search benchmark (docs/benchmarks.md) eight shorter walks found
faster plans than four longer ones in 5 of 12 setups (13B on 16 GPUs, 384 tokens: 7.08 s, against 7.21 s with
two of three seeds for four chains; 70B/128: 7.76 s against 7.94 s), a slower one in one (70B/384: 16.53 s
against 16.35 s), the same in the others."""

MIN_SEARCH_SHARE = 0.25
"""Least share of :func:`compare_plans`' time budget left to the search, however long the heuristics took."""
BOUND_SHARE = 0.25
"""Share of :func:`compare_plans`' time budget the lower bound may take (past it, it falls back to its looser
rule, which holds for every plan), but at least :data:`MIN_BOUND_S`."""
MIN_BOUND_S = 8.0
"""Seconds the lower bound may always take: enumerating an 8-GPU cluster's training placements takes ~0.8 s
here alone and over 3 s with two busy processes beside it on 2 cores, so a budget of a few seconds still gets the
placement-wise bound on a loaded machine (the bound stops as soon as it is done)."""
HEURISTIC_SHARE = 0.35
"""Share of the budget the heuristics' layout enumeration may take, after the bound (past it, each keeps the
best layouts it has simulated)."""


@dataclass
class PlanningReport:
    rows: list[dict]
    """One row per strategy and for the search: time, peak memory, speedup over colocate."""
    best: tuple[str, ExecutionPlan, SimResult]
    heuristics: dict[str, tuple[ExecutionPlan, SimResult]]
    searched: list[tuple[ExecutionPlan, SimResult]]
    bound: IterationBound
    """No synchronous plan of the search's space is faster than ``bound.seconds``
    (:mod:`loomrl.planner.search.bounds`; an asynchronous plan overlaps what it treats as a chain)."""
    modes: dict[str, tuple[ExecutionPlan, SimResult] | None] = field(default_factory=dict)
    """The fastest plan simulated of each way to run an iteration: ``synchronous`` (no fusion),
    ``stream-fused`` and ``asynchronous`` (with ``max_staleness`` > 0); None where none was feasible."""

    @property
    def search_speedup(self) -> float:
        """Searched plan vs the best feasible heuristic (≥ 1 means the search found something as good)."""
        feasible = [r.iteration_time for _, r in self.heuristics.values() if r.feasible]
        if not feasible or not self.searched:
            return float("nan")
        return min(feasible) / self.searched[0][1].iteration_time


def _fusions(plan: ExecutionPlan) -> str:
    """The plan's fusions in a few words: stream fusion (its migration), pipeline fusion (train), or no."""
    fusion = plan.stream_fusion
    parts = [] if fusion is None else [f"at {fusion.migrate_at}, to {fusion.migrate_to}"]
    parts += ["train"] if plan.pipeline_fusion else []
    parts += [f"async {plan.staleness}"] if plan.asynchronous is not None else []
    return "; ".join(parts) or "no"


MODES = {
    "synchronous": lambda p: p.stream_fusion is None and p.asynchronous is None,
    "stream-fused": lambda p: p.stream_fusion is not None,
    "asynchronous": lambda p: p.asynchronous is not None,
}
"""The ways an iteration can run that :class:`PlanningReport` shows side by side, each as a test of a plan."""


def _modes(evaluator: Evaluator, heuristics: dict, max_staleness: int) -> dict:
    """The fastest feasible plan of each of :data:`MODES` among every plan the search and the heuristics simulated
    (asynchronous only with a staleness bound)."""
    for plan, result in heuristics.values():  # simulated apart from the search: in its cache too
        evaluator.results.setdefault(plan_key(plan), (plan, result))
    return {mode: evaluator.best_of(keep) for mode, keep in MODES.items() if mode != "asynchronous" or max_staleness}


def _rows(workflow: Workflow, host_offload: bool, plans: list[tuple[str, tuple[ExecutionPlan, SimResult]]]) -> list:
    """The comparison's table: a row per plan (heuristics, then the searched one), its speedup over colocate."""
    base = dict(plans)["colocate"][1]
    rows = []
    for name, (plan, result) in plans:
        rows.append(
            {
                "plan": name,
                "feasible": result.feasible,
                "s/iteration": result.iteration_time if result.feasible else float("nan"),
                "peak GB/device": max(result.peak_memory.values(), default=0.0) / 2**30,
                "offloaded": (", ".join(plan.offloaded_roles(workflow)) or "none") if host_offload else "none (CPU)",
                "fused": _fusions(plan),
                "speedup vs colocate": (
                    base.iteration_time / result.iteration_time if base.feasible and result.feasible else float("nan")
                ),
            }
        )
    return rows


def compare_plans(
    inputs: PlannerInputs,
    *,
    seed: int = 0,
    time_budget_s: float = 30.0,
    chains: int = SEARCH_CHAINS,
    search_steps: int | None = None,
    max_staleness: int = 0,
) -> PlanningReport:
    """Best layouts of each heuristic strategy, then a seeded, time-bounded search; all simulated; and the
    lower bound on any plan's time (:func:`~loomrl.planner.search.bounds.iteration_bound`).

    ``time_budget_s`` bounds the whole comparison: the bound may take :data:`BOUND_SHARE` of it (at least
    :data:`MIN_BOUND_S`), the heuristics' enumeration up to :data:`HEURISTIC_SHARE` more, and the search what is
    left, at least :data:`MIN_SEARCH_SHARE`; each stops at its deadline with what it has (the total then exceeds
    the budget by at most the bound's minimum and the pricing of the candidate allocations, which all three
    share through one cache).

    ``search_steps`` bounds the comparison by work instead (``time_budget_s`` is then ignored): the bound and the
    heuristics run to completion and each search chain takes that many proposals, so the report is the same on
    any machine, however fast or loaded.

    ``max_staleness`` (0: synchronous and fused plans only) lets the search train asynchronously; the report then
    has the fastest synchronous, stream-fused and asynchronous plans it simulated (:attr:`PlanningReport.modes`).

    ``inputs`` carry the hardware profile (the cluster's named one, or this machine measured by
    ``loomrl calibrate``), corrections (``loomrl calibrate --from``), the weights' element size and how the system
    runs the calls (:class:`~loomrl.planner.inputs.PlannerInputs`)."""
    workflow, cluster, configs, profile = inputs.workflow, inputs.cluster, inputs.configs, inputs.profile
    if search_steps is not None:
        time_budget_s = math.inf
    began = time.monotonic()
    cost = CachedCost(inputs.cost_model())
    memory = inputs.memory_per_device
    # their prices are the search's, cached
    bound_s = max(BOUND_SHARE * time_budget_s, MIN_BOUND_S)
    bound = iteration_bound(workflow, cluster, cost, memory, configs, deadline=began + bound_s)
    heuristics = best_heuristic_plans(
        workflow, cluster, cost, memory, configs, deadline=began + bound_s + HEURISTIC_SHARE * time_budget_s
    )
    search_s = max(time_budget_s - (time.monotonic() - began), MIN_SEARCH_SHARE * time_budget_s)
    feasible = sorted(
        ((r.iteration_time, name, p) for name, (p, r) in heuristics.items() if r.feasible), key=lambda t: t[0]
    )
    # chains start from every feasible heuristic, fastest first (colocate with pure dp when none fits)
    starts = [plan for _, _, plan in feasible] or None
    evaluator = Evaluator(workflow, cost, memory, 3)
    searched = search(
        workflow,
        cluster,
        cost,
        memory,
        configs,
        seed=seed,
        time_budget_s=search_s,
        chains=chains,
        start=starts,
        max_steps=search_steps,
        max_staleness=max_staleness,
        evaluator=evaluator,
    )
    modes = _modes(evaluator, heuristics, max_staleness)
    rows = _rows(workflow, profile.host_offload, [*heuristics.items(), *(("searched", s) for s in searched[:1])])
    candidates = [(r.iteration_time, n, p, r) for n, (p, r) in heuristics.items() if r.feasible]
    candidates += [(r.iteration_time, "searched", p, r) for p, r in searched[:1]]
    if not candidates:  # report the least infeasible plan, with the reason, rather than nothing
        plan, result = heuristics["colocate"]
        return PlanningReport(rows, ("colocate (infeasible)", plan, result), heuristics, searched, bound, modes)
    _, name, plan, result = min(candidates, key=lambda t: t[0])
    return PlanningReport(rows, (name, plan, result), heuristics, searched, bound, modes)
