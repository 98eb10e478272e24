"""Test oracles: reference computations the tests check the package against, kept out of the package.

- :func:`unroll`: a workflow's calls over several iterations with their data and parameter-version edges;
- :func:`to_dot`: a workflow as Graphviz text (every key edge, for a count);
- :func:`concurrent_groups`: the maximal sets of calls a plan may run at once;
- :func:`check_trace`: whether executed steps are a schedule's, each on its devices, in a valid order.
"""

from __future__ import annotations

from collections.abc import Sequence

from loomrl.plan import ExecutionPlan
from loomrl.plan.schedule import Step
from loomrl.workflow import MFC, MFCKind, Workflow

UnrolledCall = tuple[int, MFC, list[tuple[int, str]]]
"""``(iteration, call, [(iteration, name) of each dependency])``."""


def unroll(workflow: Workflow, iterations: int) -> list[UnrolledCall]:
    """Every call of ``iterations`` training iterations with its dependencies, in a runnable order.

    Besides the data edges inside an iteration, a role's weights carry an edge across iterations: the first calls
    of a trained role in iteration ``i + 1`` (those with no earlier call of the same role among their ancestors)
    depend on the role's last calls in iteration ``i`` (those with no later call of the same role among their
    descendants), which are normally its train calls. Roles that never train get no such edge.
    """
    if iterations < 0:
        raise ValueError(f"iterations must be >= 0, got {iterations}")
    version_deps: dict[str, list[str]] = {}
    for role in workflow.roles():
        calls = workflow.mfcs_of_role(role)
        if not any(m.kind is MFCKind.TRAIN for m in calls):
            continue
        names = {m.name for m in calls}
        firsts = [m.name for m in calls if not (workflow.ancestors(m.name) & names)]
        lasts = [m.name for m in calls if not any(m.name in workflow.ancestors(n) for n in names)]
        for first in firsts:
            version_deps[first] = lasts
    unrolled: list[UnrolledCall] = []
    for it in range(iterations):
        for mfc in workflow.topological_order():
            deps = [(it, d) for d in workflow.deps(mfc.name)]
            if it > 0:
                deps += [(it - 1, d) for d in version_deps.get(mfc.name, ())]
            unrolled.append((it, mfc, deps))
    return unrolled


def to_dot(workflow: Workflow) -> str:
    """Graphviz text of the graph: calls as boxes, source keys as ovals, edges labelled by key."""
    lines = ["digraph workflow {", "  rankdir=LR;"]
    for key in sorted(workflow.source_keys):
        lines.append(f'  "key:{key}" [label="{key}", shape=oval];')
    order = workflow.topological_order()
    for mfc in order:
        where = mfc.role if mfc.role is not None else "no model"
        lines.append(f'  "{mfc.name}" [label="{mfc.name}\\n{mfc.kind.value} ({where})", shape=box];')
    producers = workflow.producers
    for mfc in order:
        for key in mfc.inputs:
            src = f"key:{key}" if key in workflow.source_keys else producers[key]
            lines.append(f'  "{src}" -> "{mfc.name}" [label="{key}"];')
    lines.append("}")
    return "\n".join(lines)


def concurrent_groups(plan: ExecutionPlan, workflow: Workflow) -> list[frozenset[str]]:
    """Maximal sets (of two or more) of calls that may run at the same time: no dependency path between any two
    of them within an iteration, and pairwise disjoint meshes. Ordered by first member."""
    order = [m.name for m in workflow.topological_order()]
    adjacent = {
        a: {b for b in order if workflow.independent(a, b) and plan[a].mesh.isdisjoint(plan[b].mesh)} for a in order
    }
    groups = [g for g in _maximal_cliques(order, adjacent) if len(g) > 1]
    return sorted(groups, key=lambda g: min(order.index(n) for n in g))


def _maximal_cliques(order: list[str], adjacent: dict[str, set[str]]) -> list[frozenset[str]]:
    """Bron–Kerbosch without pivoting: workflows have ~10 calls, and this keeps the order deterministic."""
    cliques: list[frozenset[str]] = []

    def expand(chosen: list[str], candidates: list[str], excluded: list[str]) -> None:
        if not candidates and not excluded:
            cliques.append(frozenset(chosen))
            return
        for v in list(candidates):
            expand(chosen + [v], [u for u in candidates if u in adjacent[v]], [u for u in excluded if u in adjacent[v]])
            candidates.remove(v)
            excluded.append(v)

    expand([], list(order), [])
    return cliques


def check_trace(schedule: Sequence[Step], executed: Sequence[tuple[str, dict[int, tuple[float, float]]]]) -> None:
    """Raise AssertionError unless ``executed`` (step id → device → (start, end), in the order the steps were
    recorded) ran exactly ``schedule``'s steps, each on its devices, and in a valid order: no step started on
    a device before every step it waits for had ended there, and a step not sent with its dependency started
    only after that dependency had ended everywhere."""
    by_id = {s.id: s for s in schedule}
    times = dict(executed)
    if len(times) != len(executed):
        raise AssertionError("a step was executed twice")
    if set(times) != set(by_id):
        missing, extra = sorted(set(by_id) - set(times)), sorted(set(times) - set(by_id))
        raise AssertionError(f"executed steps differ from the schedule: missing {missing}, not scheduled {extra}")
    for step in schedule:
        if tuple(sorted(times[step.id])) != step.devices:
            raise AssertionError(f"step {step.id!r} ran on {sorted(times[step.id])}, scheduled on {step.devices}")
        for dep_id in step.deps:
            dep = by_id[dep_id]
            if step.sent_with(dep):
                late = [d for d in step.devices if times[step.id][d][0] < times[dep_id][d][1]]
            else:
                ended = max(end for _, end in times[dep_id].values())
                late = [d for d in step.devices if times[step.id][d][0] < ended]
            if late:
                raise AssertionError(f"step {step.id!r} started on device {late[0]} before {dep_id!r} had ended")
