"""A fusion problem's tasks and dependencies as flat lists indexed by task id, for fast simulation and search.

Each device holds one stage of each model, so its tasks form four *streams*, ``(model, forward or backward)``,
each in micro-batch order (stream ``2 * model + backward``). A task depends on at most one task of another
device (:attr:`Graph.xpred`: a forward on the previous stage's forward, a backward on the next stage's
backward, each ``hop_s`` later) and on tasks of its own device: the previous micro-batch of its stream
(:attr:`Graph.prev`) and, for a backward, its own forward (:attr:`Graph.fwd`). A device order that keeps every
stream in order and each backward after its forward satisfies the own-device ones by itself, so the search only
ever waits on :attr:`Graph.xpred`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from loomrl.plan.pipeline_fusion import MODELS, PipelineFusionProblem, PipelineTask


@dataclass(frozen=True, eq=False)
class Graph:
    """The tasks of a :class:`PipelineFusionProblem` by id (ids follow ``problem.tasks()``)."""

    problem: PipelineFusionProblem
    tasks: tuple[PipelineTask, ...]
    index: dict[PipelineTask, int]
    device: list[int]
    dur: list[float]
    mem: list[float]
    """``+activation`` for a forward, ``-activation`` for a backward."""
    xpred: list[int]
    """The task on another device this one waits for (``hop_s`` after its end), or -1."""
    xsucc: list[int]
    """The task on another device waiting for this one, or -1."""
    fwd: list[int]
    """A backward's own forward; -1 for a forward."""
    prev: list[int]
    """The previous micro-batch's task of the same stream, or -1."""
    stream: list[int]
    """``2 * model + backward``."""
    streams: tuple[tuple[tuple[int, ...], ...], ...]
    """Per device, per stream, its task ids in micro-batch order."""

    @property
    def size(self) -> int:
        return len(self.tasks)

    def topological(self) -> list[int]:
        """PipelineTask ids in an order where every dependency comes first: forwards by stage, then backwards by
        stage from the last, each in micro-batch order."""

        def key(i: int) -> tuple:
            t = self.tasks[i]
            return (t.model, t.replica, t.backward, -t.stage if t.backward else t.stage, t.micro_batch)

        return sorted(range(self.size), key=key)


@functools.lru_cache(maxsize=64)
def build_graph(problem: PipelineFusionProblem) -> Graph:
    """The flat form of ``problem`` (cached: problems are frozen)."""
    tasks = problem.tasks()
    index = {t: i for i, t in enumerate(tasks)}
    n = len(tasks)
    device, dur, mem = [0] * n, [0.0] * n, [0.0] * n
    xpred, xsucc, fwd, prev, stream = [-1] * n, [-1] * n, [-1] * n, [-1] * n, [0] * n
    for i, t in enumerate(tasks):
        spec = problem.spec(t.model)
        device[i] = problem.device_of_task(t)
        dur[i] = spec.backward_s if t.backward else spec.forward_s
        mem[i] = -spec.activation if t.backward else spec.activation
        stream[i] = 2 * t.model + t.backward
        neighbour = t.stage + 1 if t.backward else t.stage - 1
        if 0 <= neighbour < spec.depth:
            xpred[i] = index[PipelineTask(t.model, t.replica, neighbour, t.micro_batch, t.backward)]
            xsucc[xpred[i]] = i
        if t.backward:
            fwd[i] = index[PipelineTask(t.model, t.replica, t.stage, t.micro_batch, False)]
        if t.micro_batch != problem.micro_batches_of(t.model, t.replica).start:
            prev[i] = index[PipelineTask(t.model, t.replica, t.stage, t.micro_batch - 1, t.backward)]
    streams = []
    for d in range(problem.devices):
        per = []
        for model in MODELS:
            replica, stage = problem.stage_on(model, d)
            for backward in (False, True):
                per.append(
                    tuple(
                        index[PipelineTask(model, replica, stage, k, backward)]
                        for k in problem.micro_batches_of(model, replica)
                    )
                )
        streams.append(tuple(per))
    return Graph(problem, tasks, index, device, dur, mem, xpred, xsucc, fwd, prev, stream, tuple(streams))


def finish_times(graph: Graph, orders: list[list[int]]) -> tuple[list[float], list[int]]:
    """As-soon-as-possible end time of every task when each device runs ``orders[d]`` (task ids) in turn and a
    task waits only for its cross-device predecessor; and how far each device got (short of its order's end
    where it deadlocked). Ends of tasks never run stay -1.

    Each device runs until it reaches a task whose predecessor has not run; it is woken when that one runs.
    """
    xpred, dur, hop = graph.xpred, graph.dur, graph.problem.hop_s
    end = [-1.0] * graph.size
    waiter = [-1] * graph.size
    free = [0.0] * len(orders)
    pos = [0] * len(orders)
    work = list(range(len(orders)))
    while work:
        d = work.pop()
        order, p, now = orders[d], pos[d], free[d]
        length = len(order)
        while p < length:
            t = order[p]
            x = xpred[t]
            if x >= 0:
                ready = end[x]
                if ready < 0:
                    waiter[x] = d
                    break
                ready += hop
                if ready > now:
                    now = ready
            now += dur[t]
            end[t] = now
            p += 1
            w = waiter[t]
            if w >= 0:
                work.append(w)
        pos[d], free[d] = p, now
    return end, pos


def makespan(graph: Graph, orders: list[list[int]]) -> float:
    """The as-soon-as-possible makespan of stream-ordered ``orders``; infinity if they deadlock."""
    end, pos = finish_times(graph, orders)
    if any(p < len(o) for p, o in zip(pos, orders)):
        return float("inf")
    return max(end) if end else 0.0
