"""Fused pipeline schedules as data (:mod:`loomrl.plan.fused_pipeline`): the checker rejects what an executor
could not run, the lower bound equals hand-computed values, and the search is seeded and never worse than its
start."""

from __future__ import annotations

import pytest

from loomrl.plan.fused_pipeline import (ACTOR, CRITIC, FusionProblem, PipelineSpec, Schedule, ScheduleError, Task,
                                        check, fused_schedule, lower_bound, merged_schedule, separate_schedule)

TWO = FusionProblem(2, PipelineSpec(2, 1), PipelineSpec(2, 1))
"""Two devices, one micro-batch each: the actor's stage 0 and the critic's stage 1 on device 0."""


def a(stage: int, k: int = 0, backward: bool = False) -> Task:
    return Task(ACTOR, 0, stage, k, backward)


def c(stage: int, k: int = 0, backward: bool = False) -> Task:
    return Task(CRITIC, 0, stage, k, backward)


VALID = ((a(0), c(1), c(1, backward=True), a(0, backward=True)),
         (c(0), a(1), a(1, backward=True), c(0, backward=True)))


def test_a_hand_made_schedule_runs_at_its_bound():
    timing = check(Schedule(TWO, VALID))
    assert timing.makespan == 6.0 == lower_bound(TWO)


@pytest.mark.parametrize("devices, message", [
    (((a(0, backward=True), a(0), c(1), c(1, backward=True)), VALID[1]), "before its forward"),
    (((c(1), a(0), c(1, backward=True), a(0, backward=True)),
      (a(1), c(0), a(1, backward=True), c(0, backward=True))), "deadlock"),
    (((a(0), c(1), c(1, backward=True)), VALID[1]), "missing|not scheduled|once"),
    (((a(0), c(1), c(1, backward=True), a(0, backward=True), a(0)), VALID[1]), "twice|once|more than"),
    (((a(1), c(1), c(1, backward=True), a(0, backward=True)),
      (c(0), a(0), a(1, backward=True), c(0, backward=True))), "device"),
])
def test_the_checker_rejects_what_cannot_run(devices, message):
    with pytest.raises(ScheduleError, match=message):
        check(Schedule(TWO, devices))


def test_the_checker_keeps_micro_batches_in_order_and_memory_under_the_cap():
    one = FusionProblem(1, PipelineSpec(1, 2), PipelineSpec(1, 2), memory_cap=(2.0,))

    def t(model: int, k: int, backward: bool = False) -> Task:
        return Task(model, 0, 0, k, backward)

    in_turn = (t(ACTOR, 0), t(ACTOR, 0, True), t(ACTOR, 1), t(ACTOR, 1, True),
               t(CRITIC, 0), t(CRITIC, 0, True), t(CRITIC, 1), t(CRITIC, 1, True))
    assert check(Schedule(one, (in_turn,))).makespan == 12.0
    swapped = (t(ACTOR, 1), t(ACTOR, 0), *in_turn[1:2], *in_turn[3:])
    with pytest.raises(ScheduleError, match="micro-batch order"):
        check(Schedule(one, (swapped,)))
    hoarding = (t(ACTOR, 0), t(ACTOR, 1), t(CRITIC, 0), t(ACTOR, 0, True), t(ACTOR, 1, True), t(CRITIC, 0, True),
                t(CRITIC, 1), t(CRITIC, 1, True))  # three micro-batches' activations held at once, the cap is two
    with pytest.raises(ScheduleError, match="memory cap"):
        check(Schedule(one, (hoarding,)))


@pytest.mark.parametrize("problem, bound", [
    (TWO, 6.0),  # each device's work, 1 + 2 per task pair, twice
    (FusionProblem(1, PipelineSpec(1, 1), PipelineSpec(1, 1)), 6.0),  # one device does everything
    # the critic twice as slow: its own chain, forward 2 + 2 then backward 4 + 4, is the longest thing
    (FusionProblem(2, PipelineSpec(2, 1), PipelineSpec(2, 1, 2.0, 4.0)), 12.0),
    # fusion factor 2: a one-stage critic replicated on both devices; each device has 2 actor + 1 critic pairs
    (FusionProblem(2, PipelineSpec(2, 2), PipelineSpec(1, 2)), 9.0),
])
def test_the_bound_equals_hand_computed_values_and_the_search_reaches_them(problem, bound):
    assert lower_bound(problem) == pytest.approx(bound)
    result = fused_schedule(problem, seed=0, iterations=200)
    check(result.schedule)
    assert result.makespan == pytest.approx(bound) and result.bound == pytest.approx(bound)


def test_the_search_is_seeded_and_never_worse_than_its_start():
    problem = FusionProblem(8, PipelineSpec(8, 16), PipelineSpec(4, 16, 0.5, 1.0))
    first = fused_schedule(problem, seed=3, iterations=30, time_limit_s=120)
    again = fused_schedule(problem, seed=3, iterations=30, time_limit_s=120)
    assert first.schedule == again.schedule and first.makespan == again.makespan
    start = check(merged_schedule(problem)).makespan
    assert lower_bound(problem) <= first.makespan <= start


def test_fusion_fills_the_bubbles_of_the_separate_pipelines():
    problem = FusionProblem(8, PipelineSpec(8, 8), PipelineSpec(8, 8))
    separate = check(separate_schedule(problem)).makespan
    assert separate <= 2 * (8 + 8 - 1) * 3.0  # two 1F1B pipelines one after the other (the second starting early)
    fused = fused_schedule(problem, seed=0, iterations=100)
    assert check(fused.schedule).makespan == fused.makespan <= 0.8 * separate
