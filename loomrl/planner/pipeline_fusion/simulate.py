"""Timing and validity of a fused schedule: as-soon-as-possible execution of each device's order, and the checker.

:func:`simulate` runs every device's tasks in its order, each task as soon as the device is free and its
dependencies are done: a forward waits for the previous stage's forward of its micro-batch, a backward for its
own forward and for the next stage's backward (the last stage's backward computes the loss, so it waits for its
forward only), each ``hop_s`` later when it comes from another device, and every task for the previous
micro-batch's task of its kind on its stage (streams stay in micro-batch order, so each point-to-point channel
carries its messages in order: the executor sends without blocking and receives blocking, one communicator per
model and direction). An order whose execution gets stuck is a deadlock.

:func:`check` enforces the rules an executor relies on and raises :class:`TaskOrderError` with one line naming
the device, the task and the broken rule: every task exactly once and on its stage's device; forwards and
backwards of a stage in micro-batch order; a backward after its forward; no deadlock; live activations (forwards
done whose backward is not, weighted by ``activation``) never above the device's memory cap. Memory depends on
the order alone: a device runs its tasks one at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from loomrl.plan.pipeline_fusion import PipelineTask, TaskOrder
from loomrl.planner.pipeline_fusion.graph import Graph, build_graph

__all__ = ["TaskOrderError", "Timing", "check", "simulate"]


class TaskOrderError(ValueError):
    """A schedule breaks a rule; the message is one line naming the device, the task and the rule."""


@dataclass(frozen=True)
class Timing:
    """What as-soon-as-possible execution of a schedule gives."""

    makespan: float
    """When the last task ends (every device starts at 0)."""
    start: Mapping[PipelineTask, float]
    end: Mapping[PipelineTask, float]
    busy: tuple[float, ...]
    """Per device, the seconds it computes."""
    peak_memory: tuple[float, ...]
    """Per device, the most activation memory it holds at once."""

    def idle(self, device: int) -> float:
        """Seconds ``device`` waits before the makespan."""
        return self.makespan - self.busy[device]


def _ids(schedule: TaskOrder, graph: Graph) -> list[list[int]]:
    """PipelineTask ids per device; every task exactly once, each on its stage's device."""
    problem = schedule.problem
    seen: dict[int, int] = {}  # task id → its device
    orders = []
    for d, order in enumerate(schedule.devices):
        ids = []
        for task in order:
            i = graph.index.get(task) if isinstance(task, PipelineTask) else None
            if i is None:
                raise TaskOrderError(f"device {d}: {task} is not a task of this problem")
            if i in seen:
                raise TaskOrderError(f"device {d}: {task} appears twice (also on device {seen[i]})")
            if graph.device[i] != d:
                raise TaskOrderError(f"device {d}: {task} belongs on device {graph.device[i]}, which holds its stage")
            seen[i] = d
            ids.append(i)
        orders.append(ids)
    if len(seen) != graph.size:
        missing = next(t for i, t in enumerate(graph.tasks) if i not in seen)
        raise TaskOrderError(
            f"device {problem.device_of_task(missing)}: {missing} is missing ({graph.size - len(seen)} tasks in all)"
        )
    return orders


def _deps(graph: Graph, i: int) -> list[tuple[int, float]]:
    """(task, lag) pairs task ``i`` waits for."""
    out = [(graph.xpred[i], graph.problem.hop_s)] if graph.xpred[i] >= 0 else []
    out += [(j, 0.0) for j in (graph.fwd[i], graph.prev[i]) if j >= 0]
    return out


def _run(graph: Graph, orders: list[list[int]]) -> tuple[list[float], list[float]]:
    """Start and end of every task under as-soon-as-possible execution, or :class:`TaskOrderError` (deadlock)."""
    n = graph.size
    start, end = [-1.0] * n, [-1.0] * n
    waiters: list[list[int]] = [[] for _ in range(n)]
    free, pos = [0.0] * len(orders), [0] * len(orders)
    work = list(range(len(orders)))
    while work:
        d = work.pop()
        while pos[d] < len(orders[d]):
            i = orders[d][pos[d]]
            deps = _deps(graph, i)
            blocked = next((j for j, _ in deps if end[j] < 0), None)
            if blocked is not None:
                waiters[blocked].append(d)
                break
            start[i] = max([free[d]] + [end[j] + lag for j, lag in deps])
            end[i] = free[d] = start[i] + graph.dur[i]
            pos[d] += 1
            work += waiters[i]
            waiters[i] = []
    stuck = [d for d in range(len(orders)) if pos[d] < len(orders[d])]
    if stuck:
        raise TaskOrderError(_deadlock(graph, orders, pos, end, stuck))
    return start, end


def _deadlock(graph: Graph, orders: list[list[int]], pos: list[int], end: list[float], stuck: list[int]) -> str:
    """One line naming a cycle of devices, each stuck at a task that waits for a task behind another's."""

    def wait(d: int) -> tuple[int, int]:
        i = orders[d][pos[d]]
        return i, next(j for j, _ in _deps(graph, i) if end[j] < 0)

    chain, d = [], stuck[0]
    while d not in chain:
        chain.append(d)
        d = graph.device[wait(d)[1]]
    cycle = chain[chain.index(d) :]
    parts = []
    for d in cycle:
        i, j = wait(d)
        parts.append(
            f"device {d} at {graph.tasks[i]} waits for {graph.tasks[j]}"
            + ("" if graph.device[j] == d else f" on device {graph.device[j]}")
        )
    return "deadlock: " + "; ".join(parts) + f" ({len(stuck)} devices stuck)"


def _peaks(graph: Graph, orders: list[list[int]]) -> tuple[float, ...]:
    peaks = []
    for order in orders:
        live = peak = 0.0
        for i in order:
            live += graph.mem[i]
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


def _timing(graph: Graph, orders: list[list[int]]) -> Timing:
    start, end = _run(graph, orders)
    busy = tuple(sum(graph.dur[i] for i in order) for order in orders)
    return Timing(
        max(end, default=0.0),
        MappingProxyType({graph.tasks[i]: start[i] for i in range(graph.size)}),
        MappingProxyType({graph.tasks[i]: end[i] for i in range(graph.size)}),
        busy,
        _peaks(graph, orders),
    )


def simulate(schedule: TaskOrder) -> Timing:
    """As-soon-as-possible execution of each device's order (module docstring). Raises :class:`TaskOrderError`
    when a task is missing, repeated or misplaced, or the orders deadlock; memory is measured, not capped."""
    graph = build_graph(schedule.problem)
    return _timing(graph, _ids(schedule, graph))


def check(schedule: TaskOrder) -> Timing:
    """The schedule's :class:`Timing` if it keeps every rule of the module docstring, else :class:`TaskOrderError`."""
    graph = build_graph(schedule.problem)
    orders = _ids(schedule, graph)
    for d, order in enumerate(orders):
        _check_order(graph, d, order)
    return _timing(graph, orders)


def _check_order(graph: Graph, d: int, order: list[int]) -> None:
    """Streams in micro-batch order, each backward after its forward, memory under the cap, on device ``d``."""
    done: set[int] = set()
    cap, live = graph.problem.caps[d], 0.0
    for i in order:
        task, prev, fwd = graph.tasks[i], graph.prev[i], graph.fwd[i]
        kind = "backward" if task.backward else "forward"
        if prev >= 0 and prev not in done:
            raise TaskOrderError(
                f"device {d}: {task} runs before {graph.tasks[prev]} ({kind}s of a stage run in micro-batch order)"
            )
        if fwd >= 0 and fwd not in done:
            raise TaskOrderError(f"device {d}: {task} runs before its forward {graph.tasks[fwd]}")
        live += graph.mem[i]
        if live > cap + 1e-9:
            raise TaskOrderError(
                f"device {d}: {task} raises live activations to {live:g}, above the memory cap {cap:g}"
            )
        done.add(i)
