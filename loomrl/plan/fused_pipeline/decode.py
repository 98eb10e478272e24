"""List scheduling of a fusion problem: task priorities in, each device's order out (Giffler–Thompson).

The decoder builds a schedule by simulation in time. Each device can run the next task of any of its four streams
once that task's cross-device predecessor has ended (``hop_s`` later) and, for a backward, once its own forward
has run; a forward must also fit in memory. Repeatedly, the device whose candidates could *end* earliest is
taken, and among its candidates that could *start* before that end (the conflict set of Giffler and Thompson,
which yields active schedules) the one of highest priority runs as soon as it can. ``non_delay`` restricts the
conflict set to the candidates that can start first (a non-delay schedule: never idle while a task is ready).

Memory: a forward is admitted only if the device's live activations stay under the cap while still leaving room
for one activation of the other model when that model has none live and forwards still to run. That reserve
makes the decoder deadlock-free: the earliest unfinished micro-batch of any pipeline always finds its stage's
memory free of its own model (earlier micro-batches are done, later ones wait behind it in stream order), so its
forward fits, and backwards need no memory. ``shares`` optionally caps each model's own live activations per
device as well (1F1B keeps stage ``s`` of depth ``P`` at ``P - s``), which stops one model from taking memory
the other needs later; the search tries both.

The same decoder runs the problem *reversed* (every edge turned round, streams in reverse micro-batch order,
backwards allocating and forwards freeing): a reversed schedule read backwards is a forward one, which gives the
forward-backward improvement of :func:`justify` and lets the search rebuild the beginning of a schedule while
keeping its end. A decode may also continue from a *prefix* of every device's order (tasks already placed, with
their end times), which is how the search rebuilds the rest of a schedule after a cut.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from loomrl.plan.fused_pipeline.graph import Graph, finish_times

__all__ = ["Decoder", "justify"]

Orders = list[list[int]]


class Decoder:
    """Giffler–Thompson scheduling of ``graph`` (reversed with ``reverse``); see the module docstring."""

    def __init__(self, graph: Graph, reverse: bool = False) -> None:
        problem = graph.problem
        self.graph, self.reverse = graph, reverse
        self.devices = problem.devices
        self.hop, self.dur, self.device = problem.hop_s, graph.dur, graph.device
        self.cap = problem.memory_cap
        self.activation = (problem.actor.activation, problem.critic.activation)
        self.model = [s >> 1 for s in graph.stream]
        self.stream = graph.stream
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
        # the allocating stream of each model on each device (forwards; backwards when reversed)
        self.alloc_stream = [[2 * m + reverse for m in (0, 1)] for _ in range(self.devices)]

    def run(self, priority: Sequence[float], *, shares: Sequence[Sequence[float]] | None = None,
            non_delay: bool = False, reserve: bool = True, faithful: bool = False, prefix: Orders | None = None,
            prefix_end: Sequence[float] | None = None) -> tuple[Orders, list[float]] | None:
        """Each device's order (task ids) and every task's end time; None if a prefix leaves no way on.

        ``faithful``: a device runs its highest-priority next task that memory admits, waiting for it if need
        be, and fills the wait only with tasks that end before that one can arrive; when every device waits,
        one Giffler–Thompson step breaks the tie. Given a valid schedule's start times (negated) as priorities,
        this rebuilds that schedule, which the active schedules of the default may not contain under a memory
        cap."""
        n, devices = self.graph.size, self.devices
        xpred, dur, pair, mem, streams, model = self.xpred, self.dur, self.pair, self.mem, self.streams, self.model
        cap, act, hop, alloc, device = self.cap, self.activation, self.hop, self.alloc_stream, self.device
        end = [-1.0] * n
        ptr = [[0, 0, 0, 0] for _ in range(devices)]
        free, live = [0.0] * devices, [0.0] * devices
        live_of = [[0, 0] for _ in range(devices)]
        orders: Orders = [[] for _ in range(devices)]
        placed = 0
        if prefix is not None:
            for d, tasks in enumerate(prefix):
                for t in tasks:
                    end[t] = prefix_end[t]
                    ptr[d][self.stream[t]] += 1
                    live[d] += mem[t]
                    live_of[d][model[t]] += 1 if mem[t] > 0 else -1
                orders[d] = list(tasks)
                placed += len(tasks)
                if tasks:
                    free[d] = prefix_end[tasks[-1]]

        def heads(d: int) -> list[tuple[float, int]]:
            """(earliest start, task) of each next task memory admits; start -1 while its input is unknown."""
            out = []
            per, at = streams[d], ptr[d]
            for j in range(4):
                stream = per[j]
                if at[j] >= len(stream):
                    continue
                t = stream[at[j]]
                q = pair[t]
                if q >= 0 and end[q] < 0:
                    continue
                if mem[t] > 0:
                    m = model[t]
                    other = alloc[d][1 - m]
                    room = act[1 - m] if reserve and live_of[d][1 - m] == 0 and at[other] < len(per[other]) else 0.0
                    if live[d] + act[m] + room > cap[d] + 1e-9:
                        continue
                    if shares is not None and (live_of[d][m] + 1) * act[m] > shares[d][m] + 1e-9:
                        continue
                x = xpred[t]
                ready = free[d]
                if x >= 0:
                    if end[x] < 0:
                        out.append((-1.0, t))
                        continue
                    ready = max(ready, end[x] + hop)
                out.append((ready, t))
            return out

        def active(found: list[tuple[float, int]]) -> tuple[float, float, int] | None:
            """Giffler–Thompson (or non-delay) choice among the known heads: (key, start, task)."""
            known = [(s, t) for s, t in found if s >= 0]
            if not known:
                return None
            key = min(s for s, _ in known) if non_delay else min(s + dur[t] for s, t in known)
            best = None
            for s, t in known:
                if (s <= key + 1e-12 if non_delay else s < key - 1e-12) and \
                        (best is None or priority[t] > priority[best[1]] or
                         (priority[t] == priority[best[1]] and t < best[1])):
                    best = (s, t)
            return key, best[0], best[1]

        def waiting(d: int, found: list[tuple[float, int]]) -> tuple[float, float, int] | None:
            """Faithful choice: (start, start, task), or None to wait for the top task's input."""
            if not found:
                return None
            top = max(found, key=lambda h: (priority[h[1]], -h[1]))
            if top[0] >= 0:
                return top[0], top[0], top[1]
            x = xpred[top[1]]
            arrives = free[device[x]] + dur[x] + hop  # the earliest the top task's input can come
            fill = [(s, t) for s, t in found if s >= 0 and mem[t] <= 0 and s + dur[t] <= arrives + 1e-12]
            if not fill:
                return None
            s, t = max(fill, key=lambda h: (priority[h[1]], -h[1]))
            return s, s, t

        heap: list[tuple[float, int, int]] = []
        version = [0] * devices
        chosen: list[tuple[float, float, int] | None] = [None] * devices

        def push(d: int) -> None:
            version[d] += 1
            found = heads(d)
            chosen[d] = pick = waiting(d, found) if faithful else active(found)
            if pick is not None:
                heapq.heappush(heap, (pick[0], d, version[d]))

        def place(d: int, start: float, t: int) -> None:
            nonlocal placed
            end[t] = free[d] = start + dur[t]
            orders[d].append(t)
            ptr[d][self.stream[t]] += 1
            live[d] += mem[t]
            live_of[d][model[t]] += 1 if mem[t] > 0 else -1
            placed += 1
            push(d)
            y = self.xsucc[t]
            if y >= 0:
                push(device[y])

        for d in range(devices):
            push(d)
        while placed < n:
            if not heap:  # every device waits for another: one active step
                picks = [(p, d) for d in range(devices) if (p := active(heads(d))) is not None]
                if not picks:
                    return None
                (_, start, t), d = min(picks)
                place(d, start, t)
                continue
            _, d, v = heapq.heappop(heap)
            if v == version[d]:
                _, start, t = chosen[d]
                place(d, start, t)
        return orders, end

    def merge(self, priority: Sequence[float], *, shares: Sequence[Sequence[float]] | None = None,
              prefix: Orders | None = None) -> Orders:
        """Each device's order when it always takes its highest-priority next task that memory admits, timing
        ignored: any valid order is the merge of some priorities (its own positions), so unlike :meth:`run` this
        reaches every schedule, but it can deadlock (check with :func:`~loomrl.plan.fused_pipeline.graph.
        finish_times`)."""
        mem, pair, model, act, cap = self.mem, self.pair, self.model, self.activation, self.cap
        done = [False] * self.graph.size
        orders: Orders = []
        for d in range(self.devices):
            order = list(prefix[d]) if prefix is not None else []
            at, live, live_of = [0, 0, 0, 0], 0.0, [0.0, 0.0]
            for t in order:
                done[t] = True
                at[self.stream[t]] += 1
                live += mem[t]
                live_of[model[t]] += mem[t]
            heads = self.streams[d]
            while True:
                best = -1
                for j in range(4):
                    if at[j] >= len(heads[j]):
                        continue
                    t = heads[j][at[j]]
                    if pair[t] >= 0 and not done[pair[t]]:
                        continue
                    if mem[t] > 0 and (live + mem[t] > cap[d] + 1e-9 or (
                            shares is not None and live_of[model[t]] + mem[t] > shares[d][model[t]] + 1e-9)):
                        continue
                    if best < 0 or priority[t] > priority[best]:
                        best = t
                if best < 0:
                    break
                done[best] = True
                order.append(best)
                at[self.stream[best]] += 1
                live += mem[best]
                live_of[model[best]] += mem[best]
            orders.append(order)
        return orders


def forward_orders(reversed_orders: Orders) -> Orders:
    """A reversed schedule's orders read forwards."""
    return [list(reversed(order)) for order in reversed_orders]


def justify(forward: Decoder, backward: Decoder, orders: Orders, passes: int,
            shares: Sequence[Sequence[float]] | None = None, reserve: bool = True) -> tuple[Orders, float]:
    """Forward-backward improvement: schedule the reversed problem with priority to the tasks that end last,
    then the forward one with priority to the tasks that start first in that, ``passes`` times; the best orders
    met and their makespan (never worse than ``orders``)."""
    graph = forward.graph
    end, _ = finish_times(graph, orders)
    best = (max(end), orders)
    for _ in range(passes):
        done = backward.run(end, shares=shares, reserve=reserve)
        if done is None:
            break
        rev_orders, rev_end = done
        span = max(rev_end)
        done = forward.run([rev_end[i] - span for i in range(graph.size)], shares=shares, reserve=reserve)
        if done is None:
            break
        orders = done[0]
        end, _ = finish_times(graph, orders)
        if max(end) < best[0]:
            best = (max(end), orders)
    return best[1], best[0]
