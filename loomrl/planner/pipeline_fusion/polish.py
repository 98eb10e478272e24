"""Local improvement of a fused schedule: tabu search over moves of critical tasks within a device's order.

The list-scheduling search (:mod:`~loomrl.planner.pipeline_fusion.search`) rebuilds whole stretches of a schedule;
near a good schedule most rebuilds are worse, while small gains remain in the order of the tasks on a critical
path. This step edits orders directly, as the job-shop neighbourhoods of Nowicki and Smutnicki do: it traces a
critical path of the as-soon-as-possible execution (from a task that ends last, back through whichever of its
device's previous task or its cross-device predecessor its start waited for, at random where both did), cuts it
into *blocks* (runs of path tasks that follow one another on one device) and tries, for each block, to swap its
first two or last two tasks and to move its first task to after another of the block or its last task before
one: a swap inside a block leaves that path as long, so a shorter one has to start at a block's ends. A move must
keep the device's streams in micro-batch order, each backward after its forward and the live activations under
the cap; the simulation rejects a move that deadlocks.

Each step takes the best move that is not tabu (undoing a recent move), even a worse one, so the search walks
across plateaus of equal makespan; moves are compared by makespan, then by how far tasks overrun the deadlines the
lower bound sets them (:func:`overrun`), which rewards moves toward the bound before the makespan shows it.
Deterministic for its inputs, seed and step budget.
"""

from __future__ import annotations

import random
import time
from collections import deque

from loomrl.planner.pipeline_fusion.graph import Graph, finish_times

__all__ = ["overrun", "polish"]

Orders = list[list[int]]
TENURE = 8
"""Steps a move stays tabu."""
STUCK = 50
"""Steps in a row without a move (each on another random critical path) after which the search stops."""


def overrun(end: list[float], tail: list[float], bound: float) -> float:
    """How far tasks end past the latest end a schedule of makespan ``bound`` allows them (``bound - tail``),
    summed."""
    return sum(e + q - bound for e, q in zip(end, tail) if e + q > bound)


def _critical_blocks(
    graph: Graph, orders: Orders, end: list[float], where: list[tuple[int, int]], rng: random.Random
) -> list[tuple[int, int, int]]:
    """(device, first position, last position) of each block of one critical path (module docstring)."""
    span = max(end)
    ends = [i for i, e in enumerate(end) if e >= span - 1e-9]
    t = ends[rng.randrange(len(ends))]
    hop, blocks = graph.problem.hop_s, []
    run: list[int] = []
    while t >= 0:
        d, k = where[t]
        start = end[t] - graph.dur[t]
        before = orders[d][k - 1] if k else -1
        x = graph.xpred[t]
        on_device = before >= 0 and abs(end[before] - start) < 1e-9
        across = x >= 0 and abs(end[x] + hop - start) < 1e-9
        run.append(k)
        if on_device and (not across or rng.random() < 0.5):
            t = before
            continue
        if len(run) > 1:
            blocks.append((d, run[-1], run[0]))
        run = []
        t = x if across else -1
    return blocks


def _moves(blocks: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(device, from position, to position): the block moves of the module docstring."""
    out = set()
    for d, first, last in blocks:
        out.add((d, first, first + 1))
        out.add((d, last, last - 1))
        for k in range(first + 2, last + 1):
            out.add((d, first, k))
        for k in range(first, last - 1):
            out.add((d, last, k))
    return sorted(out)


def _valid(graph: Graph, order: list[int], cap: float) -> bool:
    """Streams in micro-batch order, each backward after its forward, live activations under ``cap``."""
    seen, live = set(), 0.0
    prev, fwd, mem = graph.prev, graph.fwd, graph.mem
    for i in order:
        if (prev[i] >= 0 and prev[i] not in seen) or (fwd[i] >= 0 and fwd[i] not in seen):
            return False
        live += mem[i]
        if live > cap + 1e-9:
            return False
        seen.add(i)
    return True


def polish(
    graph: Graph,
    orders: Orders,
    tail: list[float],
    bound: float,
    *,
    rng: random.Random,
    deadline: float,
    budget: int | None = None,
) -> tuple[Orders, int]:
    """Tabu search from ``orders`` (module docstring) until the lower bound ``bound``, ``budget`` steps or
    ``deadline`` (``time.perf_counter``); the best orders met and the steps taken."""
    cap = graph.problem.caps
    orders = [list(o) for o in orders]
    end, _ = finish_times(graph, orders)
    key = (max(end), overrun(end, tail, bound))
    best, best_key = [list(o) for o in orders], key
    tabu: deque[tuple[int, int]] = deque(maxlen=TENURE)
    step = stuck = 0
    while best_key[0] > bound + 1e-9 and (budget is None or step < budget) and time.perf_counter() < deadline:
        step += 1
        where_of = [(0, 0)] * graph.size
        for d, order in enumerate(orders):
            for k, t in enumerate(order):
                where_of[t] = (d, k)
        chosen = None
        for d, i, j in _moves(_critical_blocks(graph, orders, end, where_of, rng)):
            if time.perf_counter() >= deadline:
                break
            order = orders[d]
            moved, passed = order[i], order[j]
            if graph.stream[moved] == graph.stream[passed]:
                continue
            trial = order[:i] + order[i + 1 :]
            trial.insert(j, moved)
            if not _valid(graph, trial, cap[d]):
                continue
            new = orders[:d] + [trial] + orders[d + 1 :]
            new_end, reached = finish_times(graph, new)
            if any(r < len(o) for r, o in zip(reached, new)):
                continue
            new_key = (max(new_end), overrun(new_end, tail, bound))
            # a move is tabu when it puts back an order a recent move undid
            is_tabu = (passed, moved) in tabu if j > i else (moved, passed) in tabu
            if is_tabu and new_key >= best_key:
                continue
            if chosen is None or new_key < chosen[0]:
                chosen = (new_key, new, new_end, (moved, passed) if j > i else (passed, moved))
        if chosen is None:
            stuck += 1
            if stuck >= STUCK:
                break
            continue
        stuck = 0
        key, orders, end, undo = chosen
        tabu.append(undo)
        if key < best_key:
            best, best_key = [list(o) for o in orders], key
    return best, step
