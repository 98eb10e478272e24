"""Intra-stage fusion schedules (:mod:`loomrl.plan.fused_pipeline`): the problem's layout, the checker against
hand-made invalid schedules, as-soon-as-possible timing, the lower bound against hand-computed values, and the
search (valid, deterministic for a seed, never worse than its start, never below the bound)."""

import random
import re

import pytest

from loomrl.plan.fused_pipeline import (ACTOR, CRITIC, FusionProblem, PipelineSpec, Schedule, ScheduleError, Task,
                                        check, fused_schedule, lower_bound, merged_schedule, separate_schedule,
                                        simulate)


def two_by_two(**kwargs) -> FusionProblem:
    """Two devices, both models two stages deep with two micro-batches, forward 1, backward 2."""
    return FusionProblem(2, PipelineSpec(2, 2), PipelineSpec(2, 2), **kwargs)


def a(kind: str, k: int, stage: int, replica: int = 0) -> Task:
    return Task(ACTOR, replica, stage, k, kind == "B")


def c(kind: str, k: int, stage: int, replica: int = 0) -> Task:
    return Task(CRITIC, replica, stage, k, kind == "B")


# A valid schedule of two_by_two(): device 0 holds actor stage 0 and critic stage 1, device 1 the opposite.
VALID = ((a("F", 0, 0), a("F", 1, 0), c("F", 0, 1), c("B", 0, 1), a("B", 0, 0), c("F", 1, 1), c("B", 1, 1),
          a("B", 1, 0)),
         (c("F", 0, 0), c("F", 1, 0), a("F", 0, 1), a("B", 0, 1), a("F", 1, 1), a("B", 1, 1), c("B", 0, 0),
          c("B", 1, 0)))


def schedule(problem: FusionProblem, devices) -> Schedule:
    return Schedule(problem, tuple(tuple(d) for d in devices))


# ------------------------------------------------------------------------------------------------ problem


def test_stages_run_left_to_right_and_right_to_left_with_replicas():
    problem = FusionProblem(4, PipelineSpec(4, 8), PipelineSpec(2, 8))
    assert [problem.device_of(ACTOR, 0, s) for s in range(4)] == [0, 1, 2, 3]
    assert [problem.device_of(CRITIC, r, s) for r in range(2) for s in range(2)] == [1, 0, 3, 2]
    assert problem.replicas(CRITIC) == 2 and problem.stage_on(CRITIC, 2) == (1, 1)
    assert problem.micro_batches_of(CRITIC, 1) == range(4, 8)
    # default cap: actor stage s keeps min(4 - s, 8), critic stage s of 2 keeps min(2 - s, 4)
    assert problem.memory_cap == (4 + 1, 3 + 2, 2 + 1, 1 + 2)


@pytest.mark.parametrize("kwargs, field", [
    (dict(devices=3), "actor.depth"),
    (dict(critic=PipelineSpec(1, 3)), "critic.micro_batches"),
    (dict(memory_cap=(4.0,)), "memory_cap"),
    (dict(memory_cap=(1.0, 4.0)), "memory_cap[0]"),
    (dict(hop_s=-1.0), "hop_s"),
])
def test_invalid_problems_name_the_field(kwargs, field):
    base = dict(devices=2, actor=PipelineSpec(2, 2), critic=PipelineSpec(2, 2))
    with pytest.raises(ValueError, match=re.escape(f"FusionProblem.{field}:")):
        FusionProblem(**{**base, **kwargs})
    with pytest.raises(ValueError, match=r"PipelineSpec\.backward_s"):
        PipelineSpec(2, 2, backward_s=0)


# ------------------------------------------------------------------------------------------------ checker


def test_the_checker_accepts_a_valid_schedule_and_times_it():
    timing = check(schedule(two_by_two(), VALID))
    # each device runs its own model's two forwards first (0-2), then the other model's first forward, which
    # arrived at 1; the backwards follow without a gap, so both devices are busy from 0 to 12
    assert timing.start[a("F", 0, 1)] == 2 and timing.start[c("F", 0, 1)] == 2
    assert timing.start[a("B", 0, 0)] == 5 and timing.end[c("B", 1, 0)] == 12
    assert timing.makespan == 12 and timing.busy == (12, 12) and timing.idle(0) == 0
    assert timing.peak_memory == (3, 3)


def test_hops_delay_every_message_between_devices():
    timing = simulate(schedule(two_by_two(hop_s=0.5), VALID))
    assert timing.end[a("B", 0, 1)] == 5 and timing.start[a("B", 0, 0)] == 5.5  # the gradient arrives 0.5 later
    assert timing.end[c("B", 1, 1)] == 10.5 and timing.start[c("B", 1, 0)] == 11
    assert timing.makespan == 13


@pytest.mark.parametrize("edit, message", [
    (lambda d: (d[0], (a("B", 0, 1),) + tuple(t for t in d[1] if t != a("B", 0, 1))),
     r"device 1: aB0@s1 runs before its forward aF0@s1"),
    (lambda d: ((a("F", 1, 0), a("F", 0, 0)) + d[0][2:], d[1]),
     r"device 0: aF1@s0 runs before aF0@s0 \(forwards of a stage run in micro-batch order\)"),
    (lambda d: (d[0][:-1], d[1]), r"device 0: aB1@s0 is missing"),
    (lambda d: (d[0] + (a("F", 0, 0),), d[1]), r"device 0: aF0@s0 appears twice"),
    (lambda d: (d[0][1:], (a("F", 0, 0),) + d[1]), r"device 1: aF0@s0 belongs on device 0"),
])
def test_the_checker_rejects_broken_rules(edit, message):
    with pytest.raises(ScheduleError, match=message):
        check(schedule(two_by_two(), edit(VALID)))


def test_the_checker_names_a_deadlock():
    # each device starts with the task that waits for the other's first task
    first = ((c("F", 0, 1),) + tuple(t for t in VALID[0] if t != c("F", 0, 1)),
             (a("F", 0, 1),) + tuple(t for t in VALID[1] if t != a("F", 0, 1)))
    with pytest.raises(ScheduleError, match=r"deadlock: device 0 at cF0@s1 waits for cF0@s0 on device 1; "
                                            r"device 1 at aF0@s1 waits for aF0@s0 on device 0"):
        check(schedule(two_by_two(), first))


def test_the_checker_enforces_the_memory_cap():
    with pytest.raises(ScheduleError, match=r"device 0: cF0@s1 raises live activations to 3, above the memory "
                                            r"cap 2"):
        check(schedule(two_by_two(memory_cap=(2.0, 3.0)), VALID))


def test_separate_schedule_keeps_a_tight_cap_by_shortening_warm_up():
    problem = FusionProblem(4, PipelineSpec(4, 4), PipelineSpec(4, 4), memory_cap=(2.0,) * 4)
    assert max(check(separate_schedule(problem)).peak_memory) <= 2


# ------------------------------------------------------------------------------------------------ bound


@pytest.mark.parametrize("problem, bound, why", [
    # each device holds 2 models x 2 micro-batches x (1 + 2); device 0's first task (the actor's first forward)
    # can start at 0 and its last (the actor's last backward on stage 0) leaves nothing after it
    (two_by_two(), 12, "work of a device"),
    # the critic twice as slow: 2 x 3 + 2 x 6 on every device
    (FusionProblem(2, PipelineSpec(2, 2), PipelineSpec(2, 2, 2.0, 4.0)), 18, "work of a device"),
    # fusion factor 2: the critic one stage deep, replicated twice with one micro-batch each; device 0 holds the
    # actor's stage 0 (6) and critic replica 0 (3)
    (FusionProblem(2, PipelineSpec(2, 2), PipelineSpec(1, 2)), 9, "work of a device"),
    # three stages: the middle device's tasks all wait 1 (a forward on stage 0) and leave 2 (a backward there)
    (FusionProblem(3, PipelineSpec(3, 3), PipelineSpec(3, 3)), 1 + 18 + 2, "Jackson"),
    # ... and with room for two activations: the middle device's first backward can start at 5, so before
    # that it runs at most 2 forwards (2 units of work); 16 remain, and every task leaves at least 2 after it
    (FusionProblem(3, PipelineSpec(3, 3), PipelineSpec(3, 3), memory_cap=(2.0,) * 3), 5 + 16 + 2, "memory"),
    # one model alone on a single device chain: 1F1B's (M + P - 1)(f + b) is the last stage's Jackson bound
    (FusionProblem(4, PipelineSpec(4, 4), PipelineSpec(1, 4, 0.25, 0.5)), (4 + 3) * 3, "the actor's pipeline"),
])
def test_the_bound_equals_hand_computed_values(problem, bound, why):
    assert lower_bound(problem) == pytest.approx(bound), why


def test_the_bound_reaches_the_optimum_where_it_is_known():
    for problem in (two_by_two(), FusionProblem(2, PipelineSpec(2, 2), PipelineSpec(1, 2)),
                    FusionProblem(3, PipelineSpec(3, 3), PipelineSpec(3, 3))):
        assert fused_schedule(problem, iterations=200).makespan == pytest.approx(lower_bound(problem))


def random_problem(rng: random.Random) -> FusionProblem:
    devices = rng.choice([2, 3, 4, 6])
    depths = [p for p in range(1, devices + 1) if devices % p == 0]
    specs = []
    for _ in range(2):
        depth = rng.choice(depths)
        specs.append(PipelineSpec(depth, devices // depth * rng.randint(1, 3), rng.choice([0.5, 1.0, 2.0]),
                                  rng.choice([1.0, 2.0, 3.0]), rng.choice([1.0, 2.0])))
    problem = FusionProblem(devices, *specs, hop_s=rng.choice([0.0, 0.0, 0.25]))
    if rng.random() < 0.3:  # a tighter cap, still above one micro-batch of each model
        least = specs[0].activation + specs[1].activation
        problem = FusionProblem(devices, *specs, tuple(max(least, c - 1) for c in problem.memory_cap),
                                problem.hop_s)
    return problem


def test_every_schedule_is_valid_and_no_better_than_the_bound():
    rng = random.Random(7)
    for _ in range(12):
        problem = random_problem(rng)
        bound = lower_bound(problem)
        result = fused_schedule(problem, iterations=30, seed=1)
        spans = [check(s).makespan for s in (separate_schedule(problem), merged_schedule(problem), result.schedule)]
        assert min(spans) >= bound - 1e-9
        assert result.makespan == pytest.approx(spans[2]) and result.bound == pytest.approx(bound)


# ------------------------------------------------------------------------------------------------ search


def test_the_search_is_deterministic_for_a_seed_and_never_worse_than_its_start():
    problem = FusionProblem(8, PipelineSpec(8, 8), PipelineSpec(4, 8))
    first = fused_schedule(problem, seed=3, iterations=40, time_limit_s=60.0)
    again = fused_schedule(problem, seed=3, iterations=40, time_limit_s=61.0)  # not the cached call
    assert first is not again and first.schedule == again.schedule
    assert first.makespan <= first.start_makespan <= check(merged_schedule(problem)).makespan
    assert first.start_makespan <= check(separate_schedule(problem)).makespan
    assert first.gap == pytest.approx(first.makespan / first.bound - 1)


def test_fusion_fills_the_bubbles_that_running_one_model_after_the_other_leaves():
    problem = FusionProblem(4, PipelineSpec(4, 4), PipelineSpec(4, 4))
    separate = check(separate_schedule(problem)).makespan
    fused = fused_schedule(problem, iterations=100)
    assert fused.makespan < 0.8 * separate
    assert fused.makespan == pytest.approx(lower_bound(problem))


def test_the_cheap_path_keeps_the_greedy_start():
    problem = FusionProblem(8, PipelineSpec(8, 16), PipelineSpec(8, 16))
    result = fused_schedule(problem, iterations=0)
    assert result.iterations == 0 and result.makespan == result.start_makespan
    check(result.schedule)
