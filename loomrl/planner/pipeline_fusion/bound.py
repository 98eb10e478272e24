"""A lower bound on the makespan of every valid schedule of a fusion problem.

The dependency graph of :mod:`~loomrl.planner.pipeline_fusion.simulate` holds in every valid schedule, and so do
the edges the rules add: a stage's forwards (and its backwards) run in micro-batch order on one device, so
forward ``k`` of a stage starts after forward ``k - 1`` of that stage ends (likewise backwards). In that graph,
hops on the edges between devices, every task gets a *head* ``r`` (the longest path before it can start) and a
*tail* ``q`` (the longest path after it ends). Then, for any valid schedule of makespan ``T``:

- **Paths**: ``T >= r + p + q`` for every task of duration ``p``: one micro-batch's path through the pipeline,
  and the stream of micro-batches the first stage feeds one after another.
- **Devices (Jackson)**: a device runs one task at a time, none before its head nor leaving less than its tail.
  Dropping every other constraint and allowing preemption leaves a one-machine problem that Jackson's preemptive
  schedule (run the released task with the longest tail) solves exactly; its value, ``max over task subsets S of
  min r(S) + p(S) + min q(S)`` (Carlier), bounds ``T`` from below and dominates ``head + work + tail``.
- **Devices (memory)**: let ``W`` be the device's work and ``C`` its cap. At any time ``t`` of the schedule, the
  forwards *started* before ``t`` hold at most ``C`` more activation than the backwards *ended* before ``t``
  (the cap held when each started, and only backwards free memory); a task ends after ``r + p`` and runs only
  after ``r``. So the work done before ``t`` is at most ``Can(t) = min(t - r_min, Σ_backwards min(p, t - r)⁺
  + most forward work with r < t whose activation fits in C + Σ activation of backwards with r + p < t)``, the
  last term a fractional knapsack. Read backwards in time (tails for heads, backwards taking memory and
  forwards freeing it, which holds because a device's live activation equals its unfinished backwards' minus its
  unfinished forwards'), the same bounds the work done after ``t``: ``CanAfter(t) = Can_reversed(T - t)``. Both
  halves together must reach ``W``, so ``T >= t + min{τ : Can_reversed(τ) >= W - Can(t)}`` for every ``t``;
  the bound takes the largest over ``t`` at the breakpoints of ``Can``. Where a device's early stage of one model
  meets a late stage of the other, this is what shows that the cap (the two 1F1B peaks) forces idle time until
  the first backwards come back; the memory-free bounds do not see it.

The bound is the largest of these. What it leaves out: how devices delay one another (each device is bounded
alone, with heads and tails that ignore contention), and that forwards and backwards cannot be preempted. On the
benchmark's cases that miss it, the second does not matter (the exact non-preemptive one-device optimum with
memory, solved by CP-SAT for 16/8 M16, 8/8 critic ×0.5 and 16/16 critic ×2, equals this bound): what is missing
is between devices, which :mod:`~loomrl.planner.pipeline_fusion.exact` proves when OR-Tools is installed.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math

from loomrl.plan.pipeline_fusion import PipelineFusionProblem
from loomrl.planner.pipeline_fusion.graph import Graph, build_graph

__all__ = ["device_bounds", "heads_and_tails", "jackson_preemptive", "lower_bound", "memory_bound"]

Job = tuple[float, float, float, float, bool]
"""(release, duration, tail, activation, allocates) of one task on one device; forwards allocate."""


def _preds(graph: Graph, i: int) -> list[tuple[int, float]]:
    hop = graph.problem.hop_s
    out = [(graph.xpred[i], hop)] if graph.xpred[i] >= 0 else []
    return out + [(j, 0.0) for j in (graph.fwd[i], graph.prev[i]) if j >= 0]


def heads_and_tails(graph: Graph) -> tuple[list[float], list[float]]:
    """Longest path before each task's start and after its end in the dependency graph with stream edges."""
    order = graph.topological()
    head, tail = [0.0] * graph.size, [0.0] * graph.size
    for i in order:
        for j, lag in _preds(graph, i):
            head[i] = max(head[i], head[j] + graph.dur[j] + lag)
    for i in reversed(order):
        for j, lag in _preds(graph, i):
            tail[j] = max(tail[j], tail[i] + graph.dur[i] + lag)
    return head, tail


def jackson_preemptive(jobs: list[tuple[float, float, float]]) -> float:
    """Makespan (end plus tail) of Jackson's preemptive schedule of ``(release, duration, tail)`` jobs on one
    machine: the optimum of that preemptive problem, hence a lower bound on the non-preemptive one."""
    jobs = sorted(jobs)
    ready: list[tuple[float, float]] = []  # (-tail, remaining)
    now, best, k = 0.0, 0.0, 0
    while k < len(jobs) or ready:
        if not ready and jobs[k][0] > now:
            now = jobs[k][0]
        while k < len(jobs) and jobs[k][0] <= now:
            heapq.heappush(ready, (-jobs[k][2], jobs[k][1]))
            k += 1
        neg_tail, remaining = heapq.heappop(ready)
        run = remaining if k == len(jobs) else min(remaining, jobs[k][0] - now)
        now += run
        if remaining - run > 1e-12:
            heapq.heappush(ready, (neg_tail, remaining - run))
        else:
            best = max(best, now - neg_tail)
    return best


class _WorkBefore:
    """``Can``: the most work a device can do before a time (module docstring), for jobs given as (release,
    duration, activation, allocates)."""

    def __init__(self, jobs: list[tuple[float, float, float, bool]], cap: float) -> None:
        self.cap = cap
        self.first = min(r for r, _, _, _ in jobs)
        freeing = [(r, p, a) for r, p, a, alloc in jobs if not alloc]
        self.starts = sorted(r for r, _, _ in freeing)
        self.start_sums = [0.0, *itertools.accumulate(self.starts)]
        ends = sorted((r + p, a) for r, p, a in freeing)
        self.ends = [e for e, _ in ends]
        self.end_sums = [0.0, *itertools.accumulate(self.ends)]
        self.freed = [0.0, *itertools.accumulate(a for _, a in ends)]
        groups: dict[tuple[float, float], list[float]] = {}
        for r, p, a, alloc in jobs:
            if alloc:
                groups.setdefault((p, a), []).append(r)
        # fractional knapsack: the most work per unit of memory first
        self.groups = sorted(((p, a, sorted(rs)) for (p, a), rs in groups.items()), key=lambda g: -g[0] / g[1])

    def _state(self, t: float, strict: bool) -> tuple[int, float, float]:
        """(slope, constant, knapsack work): the freeing jobs' work before ``t`` is ``slope * t - constant``."""
        cut = bisect.bisect_left if strict else bisect.bisect_right
        started, ended = cut(self.starts, t), cut(self.ends, t)
        budget = self.cap + self.freed[ended]
        work = 0.0
        for p, a, releases in self.groups:
            take = min(cut(releases, t), budget / a)
            work += take * p
            budget -= take * a
        return started - ended, self.start_sums[started] - self.end_sums[ended], work

    def value(self, t: float) -> float:
        """``Can(t)``, counting only what is released strictly before ``t``."""
        slope, constant, work = self._state(t, strict=True)
        return max(0.0, min(t - self.first, slope * t - constant + work))

    def inverse(self) -> _Inverse:
        return _Inverse(self)


class _Inverse:
    """``x -> min{τ : Can(τ) >= x}`` for a :class:`_WorkBefore`, exact on its piecewise-linear form."""

    def __init__(self, can: _WorkBefore) -> None:
        self.first = can.first
        points = sorted({can.first, *can.starts, *can.ends, *(r for _, _, rs in can.groups for r in rs)})
        self.points, self.pieces, self.reach = points, [], []
        for j, b in enumerate(points):
            slope, constant, work = can._state(b, strict=False)  # the state on (b, next breakpoint]
            self.pieces.append((slope, work - constant))
            right = points[j + 1] if j + 1 < len(points) else math.inf
            linear = slope * right + work - constant if slope else work - constant
            self.reach.append(min(right - can.first, linear))

    def __call__(self, x: float) -> float:
        j = bisect.bisect_left(self.reach, x - 1e-12)
        if j == len(self.points):
            return math.inf
        b, (slope, offset) = self.points[j], self.pieces[j]
        need = (x - offset) / slope if slope and offset < x else b
        return max(b, x + self.first, need)


def memory_bound(jobs: list[Job], cap: float) -> float:
    """The memory bound of one device's jobs (module docstring)."""
    before = _WorkBefore([(r, p, a, alloc) for r, p, q, a, alloc in jobs], cap)
    after = _WorkBefore([(q, p, a, not alloc) for r, p, q, a, alloc in jobs], cap).inverse()
    work = sum(p for _, p, _, _, _ in jobs)
    best = 0.0
    for t in sorted({r for r, *_ in jobs} | {r + p for r, p, *_ in jobs}):
        left = work - before.value(t)
        if left > 1e-12:
            best = max(best, t + after(left))
    return best


def device_bounds(graph: Graph, head: list[float], tail: list[float]) -> list[float]:
    """Per device, the larger of its Jackson and memory bounds."""
    jobs: list[list[Job]] = [[] for _ in range(graph.problem.devices)]
    for i in range(graph.size):
        jobs[graph.device[i]].append((head[i], graph.dur[i], tail[i], abs(graph.mem[i]), graph.mem[i] > 0))
    return [
        max(jackson_preemptive([(r, p, q) for r, p, q, _, _ in j]), memory_bound(j, graph.problem.caps[d]))
        if j
        else 0.0
        for d, j in enumerate(jobs)
    ]


@functools.lru_cache(maxsize=256)
def lower_bound(problem: PipelineFusionProblem) -> float:
    """The makespan no valid schedule of ``problem`` beats (module docstring)."""
    graph = build_graph(problem)
    head, tail = heads_and_tails(graph)
    path = max((head[i] + graph.dur[i] + tail[i] for i in range(graph.size)), default=0.0)
    return max([path] + device_bounds(graph, head, tail))
