"""Fused schedules: the separate baseline, a greedy start, and a seeded, time-bounded search toward the bound.

- :func:`separate_schedule`: what loomrl runs without fusion: on every device the actor's 1F1B, then the
  critic's 1F1B. Its as-soon-as-possible makespan already lets the critic start on a device once that device's
  actor work is done, so it is a little better than the two 1F1B makespans added.
- :func:`merged_schedule`: list scheduling (:class:`~loomrl.plan.fused_pipeline.decode.Decoder`) with Jackson's
  priority, the task with the longest path still behind it first; in active and non-delay form, with memory
  shared by the two models or held to each one's own 1F1B share, each followed by forward-backward improvement
  (:func:`~loomrl.plan.fused_pipeline.decode.justify`). The best of these is the start.
- :func:`fused_schedule`: large-neighbourhood search from that start. Each step cuts the current schedule at a
  random time, keeps one side of the cut as it is and rebuilds the other by list scheduling with perturbed
  priorities (each task's current start, or its tail, plus Gaussian noise), memory shared or held to 1F1B
  shares at random: keeping the beginning and rebuilding the end runs the decoder forwards from the kept prefix
  of every device's order, keeping the end rebuilds the beginning on the reversed problem. A rebuilt schedule
  replaces the current one by the simulated-annealing rule (always when no longer, else with probability
  ``exp(-increase / temperature)``, the temperature falling geometrically over the run). Rebuilding whole
  suffixes rather than swapping single tasks is what lets one step move a micro-batch's whole path, and memory
  keeps every step valid by construction. The search stops at the lower bound.

Why not per-device swaps (RLHFuse's annealing): under the default memory cap, a better schedule usually needs a
micro-batch moved on several devices at once, which single swaps only reach through long runs of worse or
invalid schedules. A step here costs one list-scheduling pass over part of the tasks plus one simulation.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import time
from dataclasses import dataclass

from loomrl.plan.fused_pipeline.bound import heads_and_tails, lower_bound
from loomrl.plan.fused_pipeline.decode import Decoder, Orders, forward_orders, justify
from loomrl.plan.fused_pipeline.graph import Graph, build_graph, finish_times
from loomrl.plan.fused_pipeline.problem import MODELS, FusionProblem, Schedule

__all__ = ["FusionResult", "fused_schedule", "merged_schedule", "separate_schedule"]

JUSTIFY_PASSES = 2
"""Forward-backward passes after each greedy start."""
TEMPERATURE = (0.5, 0.02)
"""Annealing temperature at the start and the end of a search, in units of the mean task duration."""
NOISE = (0.5, 1.0, 2.0, 4.0)
"""Standard deviations of the priority noise a rebuild draws from, in units of the mean task duration."""


@dataclass(frozen=True)
class FusionResult:
    """What :func:`fused_schedule` found."""

    schedule: Schedule
    makespan: float
    bound: float
    """:func:`~loomrl.plan.fused_pipeline.bound.lower_bound` of the problem."""
    gap: float
    """``makespan / bound - 1``."""
    seconds: float
    iterations: int
    """Rebuilds the search tried (0: the greedy start was kept)."""
    evaluations: int
    """Schedules decoded and simulated in all, the greedy start's included."""
    start_makespan: float
    """The greedy start's makespan (the better of :func:`merged_schedule` and :func:`separate_schedule`)."""


def _schedule(graph: Graph, orders: Orders) -> Schedule:
    return Schedule(graph.problem, tuple(tuple(graph.tasks[i] for i in order) for order in orders))


def _makespan(graph: Graph, orders: Orders) -> float:
    return max(finish_times(graph, orders)[0], default=0.0)


def _one_f_one_b(graph: Graph, device: int, model: int) -> list[int]:
    """``model``'s tasks on ``device`` in 1F1B order, warm-up shortened so its memory fits the cap alone."""
    problem = graph.problem
    forwards, backwards = graph.streams[device][2 * model], graph.streams[device][2 * model + 1]
    _, stage = problem.stage_on(model, device)
    depth, act = problem.spec(model).depth, problem.spec(model).activation
    warmup = min(depth - stage - 1, len(forwards))
    for s in range(stage + 1):  # warm-up never grows along the pipeline, or stages would wait on each other
        d = problem.device_of(model, problem.stage_on(model, device)[0], s)
        warmup = min(warmup, max(0, int(problem.memory_cap[d] // act) - 1))
    order = list(forwards[:warmup])
    for k in range(len(forwards) - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + list(backwards[len(forwards) - warmup:])


def separate_schedule(problem: FusionProblem) -> Schedule:
    """On every device the actor's 1F1B, then the critic's (module docstring)."""
    graph = build_graph(problem)
    return _schedule(graph, [_one_f_one_b(graph, d, 0) + _one_f_one_b(graph, d, 1) for d in range(problem.devices)])


class _Context:
    """What every decode of one problem shares: the graph, both decoders, priorities and memory shares."""

    def __init__(self, problem: FusionProblem) -> None:
        self.graph = graph = build_graph(problem)
        self.forward, self.backward = Decoder(graph), Decoder(graph, reverse=True)
        self.head, self.tail = heads_and_tails(graph)
        self.jackson = [self.tail[i] + graph.dur[i] - 0.01 * self.head[i] for i in range(graph.size)]
        self.shares = [[problem.one_f_one_b_memory(m, d) for m in MODELS] for d in range(problem.devices)]
        self.scale = sum(graph.dur) / max(1, graph.size)
        self.evaluations = 0

    def greedy(self) -> tuple[Orders, float]:
        """The best list schedule of the module docstring's start."""
        best: tuple[Orders, float] | None = None
        for shares, non_delay, reserve in itertools.product((None, self.shares), (False, True), (True, False)):
            done = self.forward.run(self.jackson, shares=shares, non_delay=non_delay, reserve=reserve)
            self.evaluations += 1
            if done is None:
                continue
            orders, span = justify(self.forward, self.backward, done[0], JUSTIFY_PASSES, shares, reserve)
            self.evaluations += 2 * JUSTIFY_PASSES
            if best is None or span < best[1]:
                best = (orders, span)
        return best

    def rebuild(self, orders: Orders, end: list[float], rng: random.Random) -> Orders | None:
        """One large-neighbourhood step (module docstring): cut, keep one side, rebuild the other."""
        graph, dur = self.graph, self.graph.dur
        span = max(end)
        start = [end[i] - dur[i] for i in range(graph.size)]
        cut = rng.uniform(0.0, span)
        shares = self.shares if rng.random() < 0.5 else None
        reserve = rng.random() < 0.75
        sigma = self.scale * rng.choice(NOISE)
        by_time = rng.random() < 0.5
        gauss = rng.gauss
        self.evaluations += 1
        if rng.random() < 0.5:
            prefix = [[t for t in order if start[t] < cut] for order in orders]
            base = [-s for s in start] if by_time else self.jackson
            done = self.forward.run([b + gauss(0.0, sigma) for b in base], shares=shares, reserve=reserve,
                                    prefix=prefix, prefix_end=end)
            return None if done is None else done[0]
        prefix = [[t for t in reversed(order) if start[t] >= cut] for order in orders]
        base = end if by_time else [self.head[i] + dur[i] for i in range(graph.size)]
        done = self.backward.run([b + gauss(0.0, sigma) for b in base], shares=shares, reserve=reserve,
                                 prefix=prefix, prefix_end=[span - s for s in start])
        return None if done is None else forward_orders(done[0])


@functools.lru_cache(maxsize=256)
def _greedy(problem: FusionProblem) -> tuple[tuple[tuple[int, ...], ...], int]:
    context = _Context(problem)
    orders, _ = context.greedy()
    return tuple(tuple(o) for o in orders), context.evaluations


def merged_schedule(problem: FusionProblem) -> Schedule:
    """The greedy start of the search (module docstring); deterministic and cached."""
    orders, _ = _greedy(problem)
    return _schedule(build_graph(problem), [list(o) for o in orders])


def fused_schedule(problem: FusionProblem, *, seed: int = 0, time_limit_s: float = 60.0,
                   iterations: int | None = None) -> FusionResult:
    """The greedy start improved by the search of the module docstring until the lower bound, ``iterations``
    rebuilds or ``time_limit_s``, whichever comes first. With ``iterations`` the result depends on ``seed``
    alone (the time limit is then only a safety cap); ``iterations=0`` is the cheap path: the start alone.
    Results are cached per arguments."""
    if iterations is not None and iterations < 0:
        raise ValueError(f"iterations: {iterations} is not >= 0")
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s: {time_limit_s!r} is not > 0")
    return _fused(problem, seed, float(time_limit_s), iterations)


@functools.lru_cache(maxsize=256)
def _fused(problem: FusionProblem, seed: int, time_limit_s: float, iterations: int | None) -> FusionResult:
    began = time.perf_counter()
    graph, bound = build_graph(problem), lower_bound(problem)
    context = _Context(problem)
    greedy, evaluations = _greedy(problem)
    context.evaluations = evaluations + 1
    separate = _schedule_orders(separate_schedule(problem), graph)
    best = min(([list(o) for o in greedy], separate), key=lambda o: _makespan(graph, o))
    start_span = _makespan(graph, best)
    best, span, steps = _anneal(context, best, bound, seed, began + time_limit_s, iterations)
    seconds = time.perf_counter() - began
    return FusionResult(_schedule(graph, best), span, bound, span / bound - 1 if bound > 0 else 0.0, seconds,
                        steps, context.evaluations, start_span)


def _schedule_orders(schedule: Schedule, graph: Graph) -> Orders:
    return [[graph.index[t] for t in order] for order in schedule.devices]


def _reached(span: float, bound: float) -> bool:
    return span <= bound + 1e-9 * max(1.0, abs(bound))


def _anneal(context: _Context, orders: Orders, bound: float, seed: int, deadline: float,
            iterations: int | None) -> tuple[Orders, float, int]:
    """Large-neighbourhood search with the annealing rule; the best orders, their makespan and the steps."""
    rng = random.Random(seed)
    graph = context.graph
    end, _ = finish_times(graph, orders)
    span = max(end, default=0.0)
    best, best_span = orders, span
    hot, cold = (t * context.scale for t in TEMPERATURE)
    began, step = time.perf_counter(), 0
    while not _reached(best_span, bound) and (iterations is None or step < iterations):
        now = time.perf_counter()
        if now >= deadline:
            break
        fraction = step / iterations if iterations else (now - began) / max(1e-9, deadline - began)
        temperature = hot * (cold / hot) ** fraction
        step += 1
        candidate = context.rebuild(orders, end, rng)
        if candidate is None:
            continue
        candidate_end, reached = finish_times(graph, candidate)
        if any(r < len(o) for r, o in zip(reached, candidate)):
            continue  # deadlock
        candidate_span = max(candidate_end)
        if candidate_span <= span or rng.random() < math.exp((span - candidate_span) / temperature):
            orders, end, span = candidate, candidate_end, candidate_span
            if span < best_span:
                best, best_span = orders, span
    return best, best_span, step
