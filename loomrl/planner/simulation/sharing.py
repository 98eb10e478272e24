"""Scheduling when devices share cores: calls running side by side on one node slow each other down.

On a CPU machine with more worker processes ("devices") than cores, a call that alone gets the cores it
needs runs slower while another call keeps other devices of the same node busy: the node's cores are shared
by every busy device (processor sharing). The cost model prices a call as if it ran alone, already slowed by
its *own* devices outnumbering the cores (``own = max(1, busy devices of the call on a node / cores)``);
running beside others, its progress rate is ``own / max(1, busy devices of all running calls on the node /
cores)`` (the smallest over the nodes it spans), which is 1 when it runs alone.

:func:`simulate_shared` is the simulator's dispatch rule (each device runs the nodes in the order they became
ready, no back-filling; ties by index) as a discrete-event simulation whose running nodes progress at those
rates. With enough cores every rate is 1 and it gives the same schedule as the simulator's list scheduling.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from collections.abc import Callable, Sequence

__all__ = ["release", "simulate_shared", "successors"]

_EPS = 1e-12


def release(successors: Sequence[int], t: float, ready_at: list[float], pending: list[int], heap: list) -> None:
    """A node ended at ``t``: each successor waits for one dependency less, and joins the ready heap (by
    ready time, then index) when none is left."""
    for j in successors:
        ready_at[j] = max(ready_at[j], t)
        pending[j] -= 1
        if pending[j] == 0:
            heapq.heappush(heap, (ready_at[j], j))


def successors(
    deps: Sequence[Sequence[int]], carried: Sequence[Sequence[int]]
) -> tuple[list[list[int]], list[list[int]]]:
    """Per node, the nodes released when it ends and those released when it is sent (the ones that wait on it
    but are sent together with it, ``carried``: :meth:`loomrl.plan.schedule.Step.sent_with`)."""
    after: list[list[int]] = [[] for _ in deps]
    with_it: list[list[int]] = [[] for _ in deps]
    for i, (ds, cs) in enumerate(zip(deps, carried)):
        for d in ds:
            (with_it if d in cs else after)[d].append(i)
    return after, with_it


def _rate(devices: Sequence[int], running_busy: Counter, node_of: Callable[[int], int], cores: float) -> float:
    own = Counter(node_of(d) for d in devices)
    return min(max(1.0, own[n] / cores) / max(1.0, running_busy[n] / cores) for n in own)


def simulate_shared(
    durations: Sequence[float],
    devices: Sequence[Sequence[int]],
    deps: Sequence[Sequence[int]],
    node_of: Callable[[int], int],
    cores: float,
    carried: Sequence[Sequence[int]] | None = None,
) -> tuple[list[float], list[float]]:
    """Start and end time of every node under processor sharing (module docstring).

    ``durations[i]``: seconds node ``i`` takes alone; ``devices[i]``: the devices it occupies; ``deps[i]``: the
    nodes it waits for (``carried[i]``: those of them it is sent together with); ``cores``: cores per node
    shared by its devices.
    """
    n = len(durations)
    after, with_it = successors(deps, carried or [()] * n)
    pending = [len(d) for d in deps]
    ready_at = [0.0] * n
    heap = [(0.0, i) for i in range(n) if not deps[i]]
    heapq.heapify(heap)
    queues: dict[int, deque[int]] = {}
    idle: set[int] = set()
    for ds in devices:
        for d in ds:
            queues.setdefault(d, deque())
            idle.add(d)
    start, end = [math.nan] * n, [math.nan] * n
    remaining: dict[int, float] = {}
    busy: Counter = Counter()
    t = 0.0
    while heap or remaining or any(queues.values()):
        while heap and heap[0][0] <= t + _EPS:  # ready: join the queue of each of its devices
            _, i = heapq.heappop(heap)
            for d in devices[i]:
                queues[d].append(i)
            release(with_it[i], t, ready_at, pending, heap)
        started = True
        while started:  # start every node at the head of all its devices' queues whose devices are idle
            started = False
            heads = {q[0] for q in queues.values() if q}
            for i in sorted(heads):
                if all(queues[d][0] == i and d in idle for d in devices[i]):
                    for d in devices[i]:
                        queues[d].popleft()
                        idle.discard(d)
                        busy[node_of(d)] += 1
                    start[i], remaining[i] = t, durations[i]
                    started = True
        rates = {i: _rate(devices[i], busy, node_of, cores) for i in remaining}
        finish = min((t + remaining[i] / rates[i] for i in remaining), default=math.inf)
        arrival = heap[0][0] if heap else math.inf
        step_to = min(finish, arrival)
        if step_to == math.inf:
            break
        for i in remaining:
            remaining[i] -= rates[i] * (step_to - t)
        t = step_to
        for i in sorted(i for i, left in remaining.items() if left <= _EPS * max(1.0, durations[i])):
            del remaining[i]
            end[i] = t
            for d in devices[i]:
                idle.add(d)
                busy[node_of(d)] -= 1
            release(after[i], t, ready_at, pending, heap)
    if any(math.isnan(s) for s in end):  # cannot happen for a validated workflow; guard the invariant
        raise RuntimeError("simulator: some nodes were never scheduled (a cycle in the unrolled graph)")
    return start, end
