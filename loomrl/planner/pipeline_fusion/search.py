"""Fused schedules: the separate baseline, a greedy start, and a seeded, time-bounded search toward the bound.

- :func:`separate_order`: what loomrl runs without fusion: on every device the actor's 1F1B, then the
  critic's 1F1B. Its as-soon-as-possible makespan already lets the critic start on a device once that device's
  actor work is done, so it is a little better than the two 1F1B makespans added.
- :func:`merged_order`: list scheduling (:class:`~loomrl.planner.pipeline_fusion.priorities.ListScheduler`) with
Jackson's
  priority, the task with the longest path still behind it first (ties to the earlier head), in active and
  non-delay form, with memory shared by the two models or held to each one's own 1F1B share, with and without
  the deadlock reserve, with and without holding a forward back for the other model's more urgent one, each
  followed by forward-backward improvement
  (:func:`~loomrl.planner.pipeline_fusion.priorities.justify`). The best of these (or the separate schedule, if better)
  is the search's start.
- :func:`fused_order`: large-neighbourhood search from that start. Each step cuts the current schedule at a
  random time, keeps one side of the cut as it is and rebuilds the other by list scheduling with perturbed
  priorities (each task's current start, or its Jackson priority, plus Gaussian noise), memory shared or held
  to 1F1B shares, the reserve and the hold on or off at random: keeping the beginning, the list scheduler runs forwards
  from the kept prefix of every device's order; keeping the end, it rebuilds the beginning on the reversed
  problem. A
  rebuilt schedule replaces the current one by the simulated-annealing rule (always when no longer, else with
  probability ``exp(-increase / temperature)``, the temperature falling geometrically), in :data:`ROUNDS`
  rounds that each restart the temperature from the best schedule so far, and each ends with local improvement
  (:func:`~loomrl.planner.pipeline_fusion.polish.polish`, tabu search over moves of critical tasks) for
  :data:`POLISH_SHARE` of its time. Then, when OR-Tools is installed and the problem lies on a time grid, CP-SAT
  (:func:`~loomrl.planner.pipeline_fusion.exact.exact_ladder`) gets :data:`EXACT_SHARE` of the time to prove
  makespans below the best one out of reach, which raises the bound, or to find a schedule at the bound. The
  search stops at the lower bound.

Why not RLHFuse's annealing over swaps of two tasks on a device: under the memory cap a better schedule usually
needs a micro-batch moved on several devices at once, which single swaps only reach through long runs of worse
or deadlocking orders; a rebuild moves whole paths and is valid by construction. A step costs one list-scheduling
pass over part of the tasks plus one simulation (a few milliseconds for a few thousand tasks). Swaps do help at
the end, near a schedule the rebuilds found, where the last idle half-units sit on one critical path: that is the
local improvement, which only moves critical tasks.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import random
import time
from dataclasses import dataclass

from loomrl.plan.pipeline_fusion import MODELS, PipelineFusionProblem, TaskOrder
from loomrl.planner.pipeline_fusion import exact as exact_module
from loomrl.planner.pipeline_fusion.bound import heads_and_tails, lower_bound
from loomrl.planner.pipeline_fusion.graph import Graph, build_graph, finish_times
from loomrl.planner.pipeline_fusion.polish import polish
from loomrl.planner.pipeline_fusion.priorities import ListScheduler, Orders, forward_orders, justify

__all__ = ["PipelineFusionResult", "fused_order", "merged_order", "separate_order"]

JUSTIFY_PASSES = 2
"""Forward-backward passes after each greedy start."""
TEMPERATURE = (0.5, 0.02)
"""Annealing temperature at the start and the end of a round, in units of the mean task duration."""
ROUNDS = 3
"""Annealing rounds, each restarting from the best schedule so far (the budget split evenly)."""
NOISE = (0.5, 1.0, 2.0, 4.0)
"""Standard deviations of the priority noise a rebuild draws from, in units of the mean task duration."""
POLISH_SHARE = 0.25
"""Share of each round's time (or rebuilds) given to local improvement at its end."""
EXACT_SHARE = 0.5
"""Share of the time limit left to CP-SAT when it is used (the list-scheduling search plateaus within seconds)."""
EXACT_WORKERS = min(8, os.cpu_count() or 1)
"""CP-SAT's parallel workers."""


@dataclass(frozen=True)
class PipelineFusionResult:
    """What :func:`fused_order` found."""

    schedule: TaskOrder
    makespan: float
    bound: float
    """:func:`~loomrl.planner.pipeline_fusion.bound.lower_bound` of the problem."""
    gap: float
    """``makespan / bound - 1``."""
    seconds: float
    iterations: int
    """Search steps tried: rebuilds and local-improvement moves (0: the start was kept)."""
    evaluations: int
    """Schedules built and simulated in all, the start's included."""
    start_makespan: float
    """The start's makespan (the better of :func:`merged_order` and :func:`separate_order`)."""
    exact_proofs: int = 0
    """Makespans CP-SAT proved out of reach (each raising ``bound`` one grid step above
    :func:`~loomrl.planner.pipeline_fusion.bound.lower_bound`); 0 when it was not used."""


def _schedule(graph: Graph, orders: Orders) -> TaskOrder:
    return TaskOrder(graph.problem, tuple(tuple(graph.tasks[i] for i in order) for order in orders))


def _span(graph: Graph, orders: Orders) -> tuple[list[float], float]:
    """Every task's end and the makespan of stream-ordered ``orders``; infinity if they deadlock."""
    end, reached = finish_times(graph, orders)
    if any(r < len(o) for r, o in zip(reached, orders)):
        return end, math.inf
    return end, max(end, default=0.0)


def _one_f_one_b(graph: Graph, device: int, model: int) -> list[int]:
    """``model``'s tasks on ``device`` in 1F1B order, warm-up shortened so its memory alone fits the cap."""
    problem = graph.problem
    forwards, backwards = graph.streams[device][2 * model], graph.streams[device][2 * model + 1]
    replica, stage = problem.stage_on(model, device)
    spec = problem.spec(model)
    warmup = min(spec.depth - stage - 1, len(forwards))
    for s in range(stage + 1):  # warm-up never grows along the pipeline, or stages would wait on each other
        warmup = min(warmup, max(0, int(problem.caps[problem.device_of(model, replica, s)] // spec.activation) - 1))
    order = list(forwards[:warmup])
    for k in range(len(forwards) - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + list(backwards[len(forwards) - warmup :])


def separate_order(problem: PipelineFusionProblem) -> TaskOrder:
    """On every device the actor's 1F1B, then the critic's (module docstring)."""
    graph = build_graph(problem)
    return _schedule(graph, [_one_f_one_b(graph, d, 0) + _one_f_one_b(graph, d, 1) for d in range(problem.devices)])


class _Context:
    """What every pass of one problem shares: the graph, both list schedulers, priorities and memory shares."""

    def __init__(self, problem: PipelineFusionProblem) -> None:
        self.graph = graph = build_graph(problem)
        self.forward, self.backward = ListScheduler(graph), ListScheduler(graph, reverse=True)
        self.head, self.tail = heads_and_tails(graph)
        self.jackson = [self.tail[i] + graph.dur[i] - 0.01 * self.head[i] for i in range(graph.size)]
        self.reversed_jackson = [self.head[i] + graph.dur[i] - 0.01 * self.tail[i] for i in range(graph.size)]
        self.shares = [[problem.one_f_one_b_memory(m, d) for m in MODELS] for d in range(problem.devices)]
        self.scale = sum(graph.dur) / max(1, graph.size)

    def greedy(self) -> tuple[Orders, int]:
        """The best list schedule of the module docstring's start, and the schedules built for it."""
        best, best_span, built = None, math.inf, 0
        for shares, non_delay, reserve, hold in itertools.product(
            (None, self.shares), (False, True), (True, False), (False, True)
        ):
            done = self.forward.run(self.jackson, shares=shares, non_delay=non_delay, reserve=reserve, hold=hold)
            built += 1
            if done is not None:
                orders, span = justify(self.forward, self.backward, done[0], JUSTIFY_PASSES, shares, reserve, hold)
                built += 2 * JUSTIFY_PASSES
                if span < best_span:
                    best, best_span = orders, span
        assert best is not None  # a pass with reserve and without hold never gets stuck (ListScheduler.run)
        return best, built

    def rebuild(self, orders: Orders, end: list[float], rng: random.Random) -> Orders | None:
        """One large-neighbourhood step (module docstring): cut, keep one side, rebuild the other."""
        dur, n = self.graph.dur, self.graph.size
        span = max(end)
        start = [end[i] - dur[i] for i in range(n)]
        cut = rng.uniform(0.0, span)
        shares = self.shares if rng.random() < 0.5 else None
        reserve = rng.random() < 0.75
        hold = rng.random() < 0.5
        sigma = self.scale * rng.choice(NOISE)
        by_time = rng.random() < 0.5
        gauss = rng.gauss
        if rng.random() < 0.5:  # keep the beginning
            prefix = [[t for t in order if start[t] < cut] for order in orders]
            base = [-s for s in start] if by_time else self.jackson
            done = self.forward.run(
                [b + gauss(0.0, sigma) for b in base],
                shares=shares,
                reserve=reserve,
                hold=hold,
                prefix=prefix,
                prefix_end=end,
            )
            return None if done is None else done[0]
        prefix = [[t for t in reversed(order) if start[t] >= cut] for order in orders]
        base = end if by_time else self.reversed_jackson
        done = self.backward.run(
            [b + gauss(0.0, sigma) for b in base],
            shares=shares,
            reserve=reserve,
            hold=hold,
            prefix=prefix,
            prefix_end=[span - s for s in start],
        )
        return None if done is None else forward_orders(done[0])


@functools.lru_cache(maxsize=64)
def _context(problem: PipelineFusionProblem) -> _Context:
    return _Context(problem)


@functools.lru_cache(maxsize=256)
def _greedy(problem: PipelineFusionProblem) -> tuple[tuple[tuple[int, ...], ...], int]:
    orders, built = _context(problem).greedy()
    return tuple(tuple(o) for o in orders), built


def merged_order(problem: PipelineFusionProblem) -> TaskOrder:
    """The best greedy list schedule (module docstring); deterministic and cached."""
    orders, _ = _greedy(problem)
    return _schedule(build_graph(problem), [list(o) for o in orders])


def fused_order(
    problem: PipelineFusionProblem,
    *,
    seed: int = 0,
    time_limit_s: float = 60.0,
    iterations: int | None = None,
    exact: bool | None = None,
) -> PipelineFusionResult:
    """The greedy start improved by the search of the module docstring until it reaches the lower bound, has
    tried ``iterations`` search steps or has run ``time_limit_s``, whichever comes first. With ``iterations`` the
    result depends on ``seed`` alone (the time limit is then only a safety cap); ``iterations=0`` is the cheap
    path: the start alone. ``exact``: whether CP-SAT gets the end of the time limit (None: when OR-Tools is
    installed and no ``iterations`` are given; its answers then depend on the time it gets). Results are cached
    per arguments."""
    if iterations is not None and (not isinstance(iterations, int) or iterations < 0):
        raise ValueError(f"iterations: {iterations!r} is not an integer >= 0")
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s: {time_limit_s!r} is not > 0")
    if exact and not exact_module.available():
        raise ValueError("exact: True needs OR-Tools (pip install 'loomrl[schedule]'), which is not installed")
    use_exact = exact if exact is not None else iterations is None and exact_module.available()
    return _fused(problem, seed, float(time_limit_s), iterations, bool(use_exact))


@functools.lru_cache(maxsize=256)
def _fused(
    problem: PipelineFusionProblem, seed: int, time_limit_s: float, iterations: int | None, use_exact: bool
) -> PipelineFusionResult:
    began = time.perf_counter()
    graph, bound, context = build_graph(problem), lower_bound(problem), _context(problem)
    greedy, built = _greedy(problem)
    separate = [[graph.index[t] for t in order] for order in separate_order(problem).devices]
    orders = min(([list(o) for o in greedy], separate), key=lambda o: _span(graph, o)[1])
    start_span = _span(graph, orders)[1]
    rng, steps = random.Random(seed), 0
    search_s = time_limit_s * (1 - EXACT_SHARE) if use_exact and iterations is None else time_limit_s
    for round_ in range(ROUNDS):
        round_end = began + search_s * (round_ + 1) / ROUNDS
        if iterations is None:
            now = time.perf_counter()
            budget, polish_budget = None, None
            anneal_end = now + (round_end - now) * (1 - POLISH_SHARE)
        else:
            budget = iterations * (round_ + 1) // ROUNDS - steps
            polish_budget = int(budget * POLISH_SHARE)
            budget, anneal_end, round_end = budget - polish_budget, began + search_s, began + search_s
        orders, tried = _anneal(context, orders, bound, rng, anneal_end, budget)
        steps += tried
        if polish_budget != 0 and not _reached(_span(graph, orders)[1], bound):
            orders, tried = polish(
                graph, orders, context.tail, bound, rng=rng, deadline=round_end, budget=polish_budget
            )
            steps += tried
    span = _span(graph, orders)[1]
    proofs = 0
    if use_exact and not _reached(span, bound):
        found = exact_module.exact_ladder(
            graph, bound, span, deadline=began + time_limit_s, seed=seed, hint=orders, workers=EXACT_WORKERS
        )
        bound, proofs = found.bound, found.proofs
        if found.orders is not None and _span(graph, found.orders)[1] < span:
            orders = found.orders
            span = _span(graph, orders)[1]
    return PipelineFusionResult(
        _schedule(graph, orders),
        span,
        bound,
        span / bound - 1 if bound > 0 else 0.0,
        time.perf_counter() - began,
        steps,
        built + 1 + steps,
        start_span,
        proofs,
    )


def _reached(span: float, bound: float) -> bool:
    return span <= bound + 1e-9 * max(1.0, abs(bound))


def _anneal(
    context: _Context, orders: Orders, bound: float, rng: random.Random, deadline: float, budget: int | None
) -> tuple[Orders, int]:
    """One round of the search from ``orders``: the best orders met and the rebuilds tried, stopping at the
    bound, after ``budget`` rebuilds (if given) or at ``deadline``."""
    graph = context.graph
    end, span = _span(graph, orders)
    best, best_span = orders, span
    hot, cold = (t * context.scale for t in TEMPERATURE)
    began, step = time.perf_counter(), 0
    while not _reached(best_span, bound) and (budget is None or step < budget):
        now = time.perf_counter()
        if now >= deadline:
            break
        fraction = step / budget if budget else (now - began) / max(1e-9, deadline - began)
        step += 1
        candidate = context.rebuild(orders, end, rng)
        if candidate is None:
            continue
        candidate_end, candidate_span = _span(graph, candidate)
        temperature = hot * (cold / hot) ** fraction
        if candidate_span <= span or rng.random() < math.exp((span - candidate_span) / temperature):
            orders, end, span = candidate, candidate_end, candidate_span
            if span < best_span:
                best, best_span = orders, span
    return best, step
