"""CP-SAT's part of fused scheduling (:mod:`loomrl.planner.pipeline_fusion.exact`, the optional ``schedule`` extra):
on tiny problems its proofs raise the bound exactly to the brute-force optimum and its schedules are valid and
optimal; without OR-Tools, asking for it fails with one line and the default search runs without it."""

import time

import pytest

from loomrl.plan.pipeline_fusion import PipelineFusionProblem, PipelineSpec, TaskOrder
from loomrl.planner.pipeline_fusion.bound import lower_bound
from loomrl.planner.pipeline_fusion.exact import available, exact_ladder
from loomrl.planner.pipeline_fusion.graph import build_graph
from loomrl.planner.pipeline_fusion.search import fused_order
from loomrl.planner.pipeline_fusion.simulate import check
from test_fused_schedule import brute_force_optimum, tiny_problems

needs_ortools = pytest.mark.skipif(not available(), reason="OR-Tools is not installed (pip install 'loomrl[schedule]')")


@needs_ortools
def test_cp_sat_proves_the_optimum_of_tiny_problems():
    raised = 0
    for problem in tiny_problems(8):
        optimum, bound = brute_force_optimum(problem), lower_bound(problem)
        graph = build_graph(problem)
        found = exact_ladder(graph, bound, optimum + 10.0, deadline=time.perf_counter() + 30)
        # asked down from the bound, it proves every makespan below the optimum out of reach, then finds one
        assert found.bound == pytest.approx(optimum) and found.orders is not None
        schedule = TaskOrder(problem, tuple(tuple(graph.tasks[i] for i in order) for order in found.orders))
        assert check(schedule).makespan == pytest.approx(optimum)
        raised += found.proofs > 0
    assert raised > 0  # some of these bounds were below the optimum


@needs_ortools
def test_the_search_with_cp_sat_reaches_a_proven_optimum_above_the_bound():
    # two devices, cap two: the critic's two stages occupy each device at fixed times, and the actor's backward
    # (3) fits in neither gap the critic leaves (2 each): the optimum is 9 against a bound of 8, and CP-SAT proves
    # both 8 and 8.5 (the grid: half units) out of reach
    problem = PipelineFusionProblem(
        2, PipelineSpec(1, 2, 0.5, 3.0), PipelineSpec(2, 1, 2.0, 2.0), memory_cap=(2.0, 2.0)
    )
    assert lower_bound(problem) == 8 and brute_force_optimum(problem) == 9
    result = fused_order(problem, time_limit_s=4.0, exact=True)
    assert result.makespan == 9 and result.bound == 9 and result.exact_proofs == 2 and result.gap == 0


def test_without_ortools_exact_is_refused_and_the_default_search_runs(monkeypatch):
    from loomrl.planner.pipeline_fusion import exact

    monkeypatch.setattr(exact, "available", lambda: False)  # as where OR-Tools is not installed
    problem = PipelineFusionProblem(2, PipelineSpec(2, 2), PipelineSpec(2, 2))
    with pytest.raises(ValueError, match=r"exact: True needs OR-Tools"):
        fused_order(problem, exact=True)
    result = fused_order(problem, time_limit_s=5.0)
    assert result.exact_proofs == 0 and result.makespan == lower_bound(problem)
