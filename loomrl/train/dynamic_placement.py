"""Dynamic placement (G-Core, ``runtime.placement: dynamic``): between iterations, re-plan for what the run
observes and switch plans when the predicted gain pays for the switch.

After each iteration the trainer hands :class:`DynamicPlacement` the plan in force, the iteration's metrics and
its response lengths (:attr:`loomrl.runtime.executor.IterationResult.response_lengths`), and it

1. refits the cost model's corrections on the run's latest iterations (``runtime.dynamic.history``: their
   per-call times, :func:`loomrl.planner.replanning.replanning.refit`);
2. takes the observed workload: every sample's response length over the last :data:`OBSERVED_ITERATIONS`
   iterations and the last prompt length;
3. searches candidate plans for it (within ``runtime.dynamic.search_s`` and ``search_share`` of the iteration's
   time) at the first check and whenever the mean sample length has drifted by more than
   ``runtime.dynamic.drift`` since the last search; at every check it prices the plan in force and the
   candidates with the refitted model;
4. prices the switch to the fastest candidate: the moves of every role's state
   (:func:`loomrl.runtime.plan_change.plan_moves`) and the new schedule's prologue, plus what earlier switches
   took beyond their price (building the new layouts' models and communicators is not in the cost model);
5. asks the switch rule (:mod:`loomrl.planner.replanning.switch_rule`) and appends the decision to
   ``RUN_DIR/placement.jsonl``.

A check that would not search is skipped while the checks so far took more than ``runtime.dynamic.check_share``
of the run's iteration time (steps 2 to 5; the iteration is still recorded): on short iterations, re-pricing
after every one would cost more than the run can gain.

The trainer applies a switch with ``apply_plan`` before the next iteration. Placement never changes the math:
the run computes what it would under any plan. A resumed run starts again from ``runtime.plan``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence

import torch

from loomrl.config.schema import TrainConfig
from loomrl.plan import ExecutionPlan
from loomrl.plan.plan_string import format_plan_string
from loomrl.plan.schedule import build_schedule
from loomrl.planner.cost.corrections import Corrections
from loomrl.planner.inputs import PlannerInputs
from loomrl.planner.replanning.replanning import Observed, price_plans, refit, search_candidates, switch_seconds
from loomrl.planner.replanning.switch_rule import CheckBudget, Decision, SwitchPolicy, SwitchRule, Telemetry
from loomrl.planner.search.evaluate import plan_key
from loomrl.role.devices import resolve_dtype
from loomrl.run_dir import RunDir
from loomrl.runtime.plan_change import plan_moves
from loomrl.runtime.spec import WorkerPlan, WorkerSpec

__all__ = ["DynamicPlacement", "OBSERVED_ITERATIONS"]

OBSERVED_ITERATIONS = 2
"""Iterations of response lengths the observed workload is made of: recent enough to follow a drift, two to
smooth one batch's luck."""


class DynamicPlacement:
    """Re-plans a Ray run between iterations and decides whether to switch (module docstring). It is given what it
    needs (the run's worker spec and cluster at construction; the plan in force, metrics and response lengths at
    each check) and reads nothing of the executor."""

    def __init__(self, cfg: TrainConfig, inputs: PlannerInputs, spec: WorkerSpec):
        rt = cfg.runtime
        self.settings, self.spec, self.seed = rt.dynamic, spec, cfg.seed
        self.path = RunDir(cfg.run_dir).placement
        self.inputs = inputs
        """The run's planner inputs (the trainer's): workflow, cluster, profile, models, workload."""
        self.prior = inputs.corrections
        """The corrections the run was given (``runtime.cost_corrections``): what it has not measured keeps them."""
        self.observed: dict[int, list[dict]] = {}
        """Each recorded iteration's calls as priced observations, kept across refits (:func:`refit`)."""
        d = rt.dynamic
        self.policy = SwitchPolicy(SwitchRule(d.window, d.margin_s, d.min_gain, d.confirm, d.dwell))
        self.masters = resolve_dtype(spec.precision, torch.device(inputs.cluster.device_kind)) != torch.float32
        """Whether the weights are 16-bit, so a switch moves their fp32 masters too."""
        self.records: list[Observed] = []
        self.lengths: list[list[int]] = []
        """The response lengths of the last :data:`OBSERVED_ITERATIONS` iterations: the observed workload."""
        self._in_force: tuple[ExecutionPlan, WorkerPlan] | None = None
        """The plan in force at the last switch priced, with what it asks of the workers (built once per plan)."""
        self.pool: list[ExecutionPlan] = []
        self.searched_seq = 0.0
        """Mean sample length of the workload the pool was searched for (0: not searched yet)."""
        self.extra_s: list[float] = []
        """Per switch so far: measured seconds beyond the priced ones."""
        self.priced_s = 0.0
        """The priced seconds of the switch just decided (compared with its measured time afterwards)."""
        self.budget = CheckBudget(d.check_share)
        """What the checks that do not search may still take (``runtime.dynamic.check_share``)."""

    def switched(self, measured_s: float) -> None:
        """The switch decided last took ``measured_s`` seconds (``apply_plan``, measured by the trainer)."""
        self.extra_s.append(max(0.0, measured_s - self.priced_s))

    def check(
        self, iteration: int, plan: ExecutionPlan, metrics: Mapping[str, float], lengths: Sequence[int], remaining: int
    ) -> tuple[Decision, ExecutionPlan | None] | None:
        """Record iteration ``iteration`` (run under ``plan``, its samples' response ``lengths``) and decide for the
        next one: the decision and the plan to switch to (None to stay); None before any iteration was measured
        without one-off costs, and for a check the budget skips (``runtime.dynamic.check_share``)."""
        began = time.perf_counter()
        first = not self.records or self.records[-1].plan != plan
        self.records = (self.records + [Observed(iteration, plan, dict(metrics), first)])[-self.settings.history :]
        self.lengths = (self.lengths + [list(lengths)])[-OBSERVED_ITERATIONS:]
        self.budget.ran(metrics.get("time/iteration_s", 0.0))
        observed = [n for past in self.lengths for n in past]
        workload = self.inputs.workload_of(observed, metrics.get("prompt/length", 0.0), metrics)
        searched = not self.searched_seq or abs(workload.mean_seq / self.searched_seq - 1) > self.settings.drift
        if not searched and not self.budget.allows():
            return None
        corrections = refit(self.inputs, self.records, self.prior, self.observed)
        if corrections is None:
            return None
        cost = self.inputs.cost_model(workload, corrections)
        if searched:
            budget = min(self.settings.search_s, self.settings.search_share * metrics["time/iteration_s"])
            self.pool = search_candidates(self.inputs, cost, plan, budget, self.seed + iteration)
            self.searched_seq = cost.workload.mean_seq
        others = [p for p in self.pool if plan_key(p) != plan_key(plan)]
        current_s, *times = price_plans([plan, *others], self.inputs.workflow, cost)
        best = min(range(len(others)), key=times.__getitem__, default=None)
        candidate, candidate_s, switch_s = None, current_s, 0.0
        if best is not None and times[best] < float("inf"):
            candidate, candidate_s = others[best], times[best]
            switch_s = self._switch_price(cost, plan, candidate)
        telemetry = Telemetry(
            iteration,
            current_s,
            candidate_s,
            switch_s,
            remaining,
            self._text(plan),
            self._text(candidate) if candidate is not None else "",
        )
        decision = self.policy.decide(telemetry)
        self.priced_s = switch_s - self._extra()
        self._log(decision, searched, len(self.pool), corrections)
        if not searched:
            self.budget.spent(time.perf_counter() - began)
        return decision, candidate if decision.switch else None

    def _switch_price(self, cost, plan: ExecutionPlan, candidate: ExecutionPlan) -> float:
        """Priced seconds of switching from ``plan`` (the plan in force) to ``candidate``, plus the mean unpriced
        remainder of the switches measured so far."""
        if self._in_force is None or self._in_force[0] != plan:
            self._in_force = (plan, self._worker_plan(plan))
        new = self._worker_plan(candidate)
        stepped = {role: 1 for role, spec in self.spec.roles.items() if spec.trained}  # every check follows a step
        moves = plan_moves(self._in_force[1], new, self.spec.roles, self.masters, stepped, lambda *_: None)
        return switch_seconds(cost, moves, new.schedule.prologue) + self._extra()

    def _worker_plan(self, plan: ExecutionPlan) -> WorkerPlan:
        """What ``plan`` asks of the workers as one controller runs it (dynamic placement runs with one: a config
        rule; the executor's plan is then ``plan`` itself), without transfer plans: :func:`plan_moves` needs what
        moves (the schedule's allocations), not how."""
        schedule = build_schedule(self.inputs.workflow, plan)
        return WorkerPlan(schedule, {t: None for t in schedule.transfers()})

    def _extra(self) -> float:
        return sum(self.extra_s) / len(self.extra_s) if self.extra_s else 0.0

    def _text(self, plan: ExecutionPlan) -> str:
        return format_plan_string(plan, self.inputs.workflow)

    def _log(self, decision: Decision, searched: bool, candidates: int, corrections: Corrections) -> None:
        record = {
            **decision.to_dict(),
            "searched": searched,
            "candidates": candidates,
            "corrections": corrections.to_dict(),
        }
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def timed_check(
    placement: DynamicPlacement,
    iteration: int,
    plan: ExecutionPlan,
    metrics: dict,
    lengths: Sequence[int],
    remaining: int,
) -> ExecutionPlan | None:
    """Run ``placement``'s check of iteration ``iteration`` (its response ``lengths``), adding the decision and the
    seconds it took to ``metrics``; the plan to switch to, or None."""
    t0 = time.perf_counter()
    outcome = placement.check(iteration, plan, metrics, lengths, remaining)
    metrics["time/placement_s"] = time.perf_counter() - t0
    if outcome is None:
        return None
    decision, new = outcome
    metrics.update(decision.metrics())
    return new
