"""List scheduling of a fusion problem: task priorities in, each device's order out (Giffler–Thompson).

The list scheduler builds a schedule by simulation in time. Each device can run the next task of any of its four streams
once that task's cross-device predecessor has ended (``hop_s`` later) and, for a backward, once its own forward
has run; a forward must also fit in memory. Repeatedly, the device whose candidates could *end* earliest is
taken, and among its candidates that could *start* before that end (the conflict set of Giffler and Thompson,
which yields active schedules) the one of highest priority runs as soon as it can. ``non_delay`` restricts the
conflict set to the candidates that can start first (a non-delay schedule: never idle while a task is ready).

Memory: a forward is admitted only if the device's live activations stay under the cap while still leaving room
for one activation of the other model when that model has none live and forwards still to run. That reserve
makes the list scheduler deadlock-free: the earliest unfinished micro-batch of any pipeline always finds its stage's
memory free of its own model (earlier micro-batches are done, later ones wait behind it in stream order), so its
forward fits, and backwards need no memory. Under a cap close to one activation of each model the reserve holds
each model to one micro-batch per device, so the search also list-schedules without it (a pass that gets stuck then
returns None). ``shares`` optionally caps each model's own live activations per device as well (1F1B keeps stage
``s`` of depth ``P`` at ``P - s``), which stops one model from taking memory the other needs later.

``hold`` lets the priorities decide memory too: a forward is not admitted when the other model's next forward on
the device has the higher priority, fits now and would no longer fit after it, even if that one has not arrived
yet and the device would otherwise idle. Without it the list scheduler only makes schedules in which a forward that fits
and is ready runs unless a task of higher priority can start before it would end; under a tight cap the best
schedules often hold a forward back for longer, to keep its memory for the other model's next micro-batch. On four
devices with both models four stages deep, 8 micro-batches and the critic at half cost, an optimal schedule (39,
the bound; found by CP-SAT) list-schedules from its own start times with ``hold`` and to 40.5 at best without it, with
or without reserve and shares (``tests/test_fused_schedule.py``). A hold can deadlock a pass, which then
returns None.

The same list scheduler runs the problem *reversed* (every edge turned round, streams in reverse micro-batch order,
backwards allocating and forwards freeing): a reversed schedule read backwards is a forward one, which gives the
forward-backward improvement of :func:`justify` and lets the search rebuild the beginning of a schedule while
keeping its end. A pass may also continue from a *prefix* of every device's order (tasks already placed, with
their end times), which is how the search rebuilds the rest of a schedule after a cut.

What it still cannot produce: schedules that are not *active* in that sense for reasons other than memory (a device
idle while a ready task would end before anything more urgent arrives)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from loomrl.planner.pipeline_fusion.graph import Graph, finish_times

__all__ = ["ListScheduler", "forward_orders", "justify"]

Orders = list[list[int]]
"""Per device, task ids in execution order."""


class ListScheduler:
    """Giffler–Thompson scheduling of ``graph`` (reversed with ``reverse``); see the module docstring."""

    def __init__(self, graph: Graph, reverse: bool = False) -> None:
        problem = graph.problem
        self.graph, self.reverse = graph, reverse
        self.cap = problem.caps
        self.activation = (problem.actor.activation, problem.critic.activation)
        self.model = [s >> 1 for s in graph.stream]
        if not reverse:
            self.streams = [[list(s) for s in per] for per in graph.streams]
            self.xpred, self.xsucc, self.pair, self.mem = graph.xpred, graph.xsucc, graph.fwd, graph.mem
        else:
            self.streams = [[list(reversed(s)) for s in per] for per in graph.streams]
            self.xpred, self.xsucc = graph.xsucc, graph.xpred
            self.pair = [-1] * graph.size  # reversed, a forward waits for its own backward
            for i, f in enumerate(graph.fwd):
                if f >= 0:
                    self.pair[f] = i
            self.mem = [-m for m in graph.mem]
        self.allocating = (int(reverse), 2 + int(reverse))
        """Each model's allocating stream on a device: its forwards (its backwards when reversed)."""

    def run(
        self,
        priority: Sequence[float],
        *,
        shares: Sequence[Sequence[float]] | None = None,
        non_delay: bool = False,
        reserve: bool = True,
        hold: bool = False,
        prefix: Orders | None = None,
        prefix_end: Sequence[float] | None = None,
    ) -> tuple[Orders, list[float]] | None:
        """Each device's order and every task's end time, continuing after ``prefix`` (whose tasks end at
        ``prefix_end``) if given; None if the pass gets stuck (possible without ``reserve``, with ``hold``, or
        after a prefix built so)."""
        graph = self.graph
        devices, n = graph.problem.devices, graph.size
        end = [-1.0] * n
        at = [[0, 0, 0, 0] for _ in range(devices)]
        free, live = [0.0] * devices, [0.0] * devices
        live_of = [[0, 0] for _ in range(devices)]
        orders: Orders = [[] for _ in range(devices)]
        for d, tasks in enumerate(prefix or ()):
            assert prefix_end is not None  # given with a prefix
            for t in tasks:
                end[t] = prefix_end[t]
                at[d][graph.stream[t]] += 1
                live[d] += self.mem[t]
                live_of[d][self.model[t]] += 1 if self.mem[t] > 0 else -1
            orders[d] = list(tasks)
            free[d] = prefix_end[tasks[-1]] if tasks else 0.0
        state = (end, at, free, live, live_of, orders)
        self._schedule(state, priority, shares, non_delay, reserve, hold)
        return (orders, end) if sum(map(len, orders)) == n else None

    def _schedule(self, state, priority, shares, non_delay, reserve, hold) -> None:
        """The Giffler–Thompson loop over ``state`` (module docstring), in place."""
        end, at, free, live, live_of, orders = state
        xpred, xsucc, pair, mem, streams, model = self.xpred, self.xsucc, self.pair, self.mem, self.streams, self.model
        dur, device, stream, cap, act, allocating = (
            self.graph.dur,
            self.graph.device,
            self.graph.stream,
            self.cap,
            self.activation,
            self.allocating,
        )
        hop = self.graph.problem.hop_s

        def candidates(d: int) -> list[tuple[float, int]]:
            """(earliest start, task) of each next task of ``d`` that can run once the device is free."""
            out, per, here = [], streams[d], at[d]
            for j in range(4):
                if here[j] >= len(per[j]):
                    continue
                t = per[j][here[j]]
                x, q = xpred[t], pair[t]
                if (x >= 0 and end[x] < 0) or (q >= 0 and end[q] < 0):
                    continue
                if mem[t] > 0:
                    m, other = model[t], allocating[1 - model[t]]
                    room = act[1 - m] if reserve and live_of[d][1 - m] == 0 and here[other] < len(per[other]) else 0.0
                    if live[d] + act[m] + room > cap[d] + 1e-9 or (
                        shares is not None and (live_of[d][m] + 1) * act[m] > shares[d][m] + 1e-9
                    ):
                        continue
                    if (
                        hold
                        and here[other] < len(per[other])
                        and priority[per[other][here[other]]] > priority[t]
                        and live[d] + act[1 - m] <= cap[d] + 1e-9 < live[d] + act[m] + act[1 - m]
                    ):
                        continue  # the other model's next forward comes first and would no longer fit
                ready = end[x] + hop if x >= 0 else 0.0
                out.append((ready if ready > free[d] else free[d], t))
            return out

        heap: list[tuple[float, int, int]] = []
        version = [0] * len(free)
        found: list[list[tuple[float, int]]] = [[] for _ in free]

        def push(d: int) -> None:
            version[d] += 1
            found[d] = here = candidates(d)
            if here:
                key = min(s for s, _ in here) if non_delay else min(s + dur[t] for s, t in here)
                heapq.heappush(heap, (key, d, version[d]))

        for d in range(len(free)):
            push(d)
        while heap:
            key, d, v = heapq.heappop(heap)
            if v != version[d]:
                continue
            best_t, best_s = -1, 0.0
            for s, t in found[d]:
                in_conflict = s <= key + 1e-12 if non_delay else s < key - 1e-12
                if in_conflict and (
                    best_t < 0 or priority[t] > priority[best_t] or (priority[t] == priority[best_t] and t < best_t)
                ):
                    best_t, best_s = t, s
            end[best_t] = free[d] = best_s + dur[best_t]
            orders[d].append(best_t)
            at[d][stream[best_t]] += 1
            live[d] += mem[best_t]
            live_of[d][model[best_t]] += 1 if mem[best_t] > 0 else -1
            push(d)
            if xsucc[best_t] >= 0:
                push(device[xsucc[best_t]])


def forward_orders(reversed_orders: Orders) -> Orders:
    """A reversed schedule's orders read forwards."""
    return [list(reversed(order)) for order in reversed_orders]


def justify(
    forward: ListScheduler,
    backward: ListScheduler,
    orders: Orders,
    passes: int,
    shares: Sequence[Sequence[float]] | None = None,
    reserve: bool = True,
    hold: bool = False,
) -> tuple[Orders, float]:
    """Forward-backward improvement: schedule the reversed problem with priority to the tasks that end last,
    then the forward one with priority to the tasks that start first in that, ``passes`` times; the best orders
    met and their makespan (never worse than ``orders``)."""
    graph = forward.graph
    end, _ = finish_times(graph, orders)
    best = (max(end), orders)
    for _ in range(passes):
        done = backward.run(end, shares=shares, reserve=reserve, hold=hold)
        if done is None:
            break
        rev_end = done[1]
        span = max(rev_end)
        done = forward.run([e - span for e in rev_end], shares=shares, reserve=reserve, hold=hold)  # minus the start
        if done is None:
            break
        orders = done[0]
        end, _ = finish_times(graph, orders)
        if max(end) < best[0]:
            best = (max(end), orders)
    return best[1], best[0]
