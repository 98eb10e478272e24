"""Exact reasoning with Google OR-Tools CP-SAT, when it is installed (the ``schedule`` extra): a better schedule,
or a proof that none of a given makespan exists.

The model is the problem itself, not a relaxation: one fixed-length interval per task on a time grid, no overlap on
a device, every dependency of :mod:`~loomrl.planner.pipeline_fusion.simulate` as a precedence (``hop_s`` on the edges
between devices), and on each device a cumulative constraint over one interval per micro-batch and stage, from its
forward's start to its backward's end, of height its activation and capacity the cap. That is exactly the
checker's memory rule: a device runs one task at a time, so the live activations after each task of its order are
the heights of the intervals open at that task's start (an interval closes at its backward's end, before anything
that starts then). Heights are activations in units of their common grain, so the capacity, the cap in those
units rounded down, admits exactly the same sets. Each task's start lies in ``[head, T - tail - duration]``
(:func:`~loomrl.planner.pipeline_fusion.bound.heads_and_tails`: longest paths of dependencies every valid schedule
keeps), which every schedule of makespan at most ``T`` satisfies.

Why a grid loses nothing: when every duration and ``hop_s`` is a whole multiple of one grain ``g``, the
as-soon-as-possible execution of any valid order starts every task at a sum of durations and hops, a multiple of
``g``, and is no longer than any other timing of that order. So a schedule of makespan at most ``T`` exists if and
only if one exists on the grid, and every optimum is a multiple of ``g``. :func:`exact_ladder` asks, for ``T``
the lower bound rounded up to the grid, whether a schedule of makespan at most ``T`` exists: CP-SAT's
"infeasible" proves the optimum is at least ``T + g`` (the bound rises, and it asks again); a solution is a
schedule of makespan ``T``, optimal since nothing shorter exists; running out of time leaves the bound where it
was. Problems whose durations, hop or activations are not all fractions of denominator at most 1000, or whose
horizon is over a million grid steps, are left alone.

Why CP-SAT rather than more of our own search: a proof that a makespan is out of reach needs search with
propagation and learning over every order at once, which is what a constraint solver is; list scheduling
(:mod:`~loomrl.planner.pipeline_fusion.priorities`) only ever finds schedules. Optional because the library is large and
native; without it the search and the bound of :mod:`~loomrl.planner.pipeline_fusion.bound` stand alone.
"""

from __future__ import annotations

import functools
import importlib
import math
import time
from dataclasses import dataclass
from fractions import Fraction
from functools import reduce

from loomrl.planner.pipeline_fusion.bound import heads_and_tails
from loomrl.planner.pipeline_fusion.graph import Graph, finish_times

__all__ = ["ExactResult", "available", "exact_ladder", "grain"]

Orders = list[list[int]]
MAX_DENOMINATOR = 1000
MAX_STEPS = 1_000_000
MIN_SECONDS = 0.5
"""Time kept in hand before a deadline: a question is not asked with less left, and reading back its answer
takes some of it."""


@functools.cache
def available() -> bool:
    """Whether OR-Tools' CP-SAT can be imported."""
    try:
        importlib.import_module("ortools.sat.python.cp_model")
    except ImportError:
        return False
    return True


def _fraction(x: float) -> Fraction | None:
    f = Fraction(x).limit_denominator(MAX_DENOMINATOR)
    return f if abs(float(f) - x) <= 1e-9 * max(1.0, abs(x)) else None


def grain(values: list[float]) -> float | None:
    """The largest ``g`` of which every value is a whole multiple (denominators up to 1000), or None."""
    fractions = [_fraction(v) for v in values if v]
    if not fractions or any(f is None for f in fractions):
        return None if any(f is None for f in fractions) else 1.0
    exact = [f for f in fractions if f is not None]  # all of them, none being None here
    numerator = reduce(math.gcd, (f.numerator for f in exact))
    denominator = reduce(lambda a, b: a * b // math.gcd(a, b), (f.denominator for f in exact))
    return numerator / denominator


@dataclass(frozen=True)
class ExactResult:
    """What :func:`exact_ladder` established."""

    bound: float
    """A lower bound on every valid schedule's makespan, at least the one given."""
    orders: Orders | None
    """A schedule of makespan ``bound`` (hence optimal), when CP-SAT found one; else None."""
    proofs: int
    """Makespans CP-SAT proved out of reach."""


def exact_ladder(
    graph: Graph,
    bound: float,
    best: float,
    *,
    deadline: float,
    seed: int = 0,
    hint: Orders | None = None,
    workers: int = 1,
) -> ExactResult:
    """Raise ``bound`` towards ``best`` (the makespan of a known schedule, e.g. ``hint``'s) one grid step at a
    time while CP-SAT proves each out of reach before ``deadline`` (``time.perf_counter``), and stop with a
    schedule when one of the makespan asked exists (module docstring)."""
    problem = graph.problem
    step = grain([*graph.dur, problem.hop_s])
    if step is None or grain([abs(m) for m in graph.mem]) is None or not available():
        return ExactResult(bound, None, 0)
    target = math.ceil(bound / step - 1e-9) * step
    if best / step > MAX_STEPS:
        return ExactResult(bound, None, 0)
    head, tail = heads_and_tails(graph)
    hint_start = None
    if hint is not None:
        end, _ = finish_times(graph, hint)
        hint_start = [round((end[i] - graph.dur[i]) / step) for i in range(graph.size)]
    proofs = 0
    while target < best - 1e-9 * max(1.0, best) and deadline - time.perf_counter() > MIN_SECONDS:
        status, starts = _decide(graph, head, tail, round(target / step), step, deadline, seed, hint_start, workers)
        if status == "infeasible":
            proofs += 1
            bound, target = max(bound, target + step), target + step
            continue
        if status == "feasible":
            assert starts is not None  # _decide gives them with "feasible"
            return ExactResult(max(bound, target), _orders(graph, starts), proofs)
        break
    return ExactResult(bound, None, proofs)


def _decide(
    graph: Graph,
    head: list[float],
    tail: list[float],
    horizon: int,
    step: float,
    deadline: float,
    seed: int,
    hint: list[int] | None,
    workers: int,
) -> tuple[str, list[int] | None]:
    """CP-SAT's answer by ``deadline`` to "is there a schedule of makespan at most ``horizon`` grid steps":
    "infeasible", "feasible" (with every task's start in steps) or "unknown"."""
    from ortools.sat.python import cp_model

    problem, n = graph.problem, graph.size
    model = cp_model.CpModel()
    start, end, interval = [], [], []
    for i in range(n):
        length = round(graph.dur[i] / step)
        low = math.ceil(head[i] / step - 1e-9)
        high = horizon - math.ceil(tail[i] / step - 1e-9) - length
        if high < low:
            return "infeasible", None
        start.append(model.new_int_var(low, high, f"s{i}"))
        end.append(start[i] + length)
        interval.append(model.new_fixed_size_interval_var(start[i], length, f"t{i}"))
        if hint is not None:
            model.add_hint(start[i], hint[i])
    hop = round(problem.hop_s / step)
    for i in range(n):
        if graph.xpred[i] >= 0:
            model.add(start[i] >= end[graph.xpred[i]] + hop)
        for j in (graph.fwd[i], graph.prev[i]):
            if j >= 0:
                model.add(start[i] >= end[j])
    _devices(model, graph, start, end, interval, horizon)
    seconds = deadline - time.perf_counter() - MIN_SECONDS  # building the model took some; reading back takes some
    if seconds <= 0:
        return "unknown", None
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = seconds
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    status = solver.solve(model)
    if status == cp_model.INFEASIBLE:
        return "infeasible", None
    if status in (cp_model.FEASIBLE, cp_model.OPTIMAL):
        return "feasible", [solver.value(s) for s in start]
    return "unknown", None


def _devices(model, graph: Graph, start, end, interval, horizon: int) -> None:
    """No overlap on each device, and its activation memory as a cumulative (module docstring)."""
    problem = graph.problem
    unit = grain([abs(m) for m in graph.mem])
    assert unit is not None  # exact_ladder builds a model only where the memory has a grain
    per_device: list[list[int]] = [[] for _ in range(problem.devices)]
    for i in range(graph.size):
        per_device[graph.device[i]].append(i)
    for d, tasks in enumerate(per_device):
        model.add_no_overlap([interval[i] for i in tasks])
        held, height = [], []
        for i in tasks:
            f = graph.fwd[i]
            if f >= 0:
                size = model.new_int_var(0, horizon, f"m{i}")
                held.append(model.new_interval_var(start[f], size, end[i], f"h{i}"))
                height.append(round(abs(graph.mem[i]) / unit))
        model.add_cumulative(held, height, math.floor(problem.caps[d] / unit + 1e-9))


def _orders(graph: Graph, starts: list[int]) -> Orders:
    """Each device's tasks by start."""
    orders: Orders = [[] for _ in range(graph.problem.devices)]
    for i in sorted(range(graph.size), key=lambda i: starts[i]):
        orders[graph.device[i]].append(i)
    return orders
