"""The planner's price of a fused stage (:mod:`loomrl.planner.cost.stream_fusion`): hand-computed on a stub cost model,
then
on the real one through the simulator."""

import pytest

from loomrl.algorithms.workflows import build_workflow
from loomrl.config.schema import AlgoConfig, RolloutConfig
from loomrl.plan import ClusterSpec, make_plan
from loomrl.plan.hardware import PROFILES
from loomrl.plan.model_shape import ModelShape
from loomrl.plan.schedule import StepKind, build_schedule
from loomrl.planner.cost.corrections import Corrections
from loomrl.planner.cost.model import CostModel
from loomrl.planner.cost.stream_fusion import best_migrate_at, price_stream_fusion
from loomrl.planner.cost.workload import Workload
from loomrl.planner.simulation.simulator import simulate

GRPO = build_workflow(AlgoConfig(name="grpo"), RolloutConfig())
PPO = build_workflow(AlgoConfig(name="ppo"), RolloutConfig())


class _StubCost:
    """Round numbers: a decode step costs 1 s whatever is live, prefilling 0.1 s a sample, scoring 0.25 s a
    sample; the reward role (a rule) has no model and costs nothing."""

    system_factor = 1.0

    def __init__(self, workload: Workload):
        self.workload, self.corrections, self.shapes = workload, Corrections(), {"actor": "stub", "ref": "stub"}

    def decode_segment_terms(self, role, alloc, segments):
        return {"decode": float(sum(s.end - s.start for s in segments))}

    def prefill_terms(self, role, alloc, samples, context):
        return {"prefill": 0.1 * samples}

    def inference_terms(self, role, alloc, samples=None, lengths=None):
        return {"inference": 0.25 * samples}


def _fused(text: str):
    schedule = build_schedule(GRPO, make_plan(text, GRPO, ClusterSpec.parse("cpu:2")))
    (step,) = [s for s in schedule if s.kind is StepKind.STREAM_FUSION]
    return step


# Eight samples, half of 2 tokens and half of 10, dealt two of each to each of the two generation replicas.
EIGHT = Workload(batch=8, prompt_len=4, response_lengths=(2, 2, 2, 2, 10, 10, 10, 10))


def _by_label(price):
    out = {}
    for label, device, start, end in price.parts:
        out.setdefault(label, []).append((device, round(start, 9), round(end, 9)))
    return {k: sorted(v) for k, v in out.items()}


def test_without_a_migration_scoring_waits_for_the_generating_devices():
    # each replica: prefill 4 samples (0.4 s), its short pair done at 2.4 s, its long pair at 10.4 s; both
    # devices generate until 10.4 s, so all 8 samples are scored then, 4 per replica: 1 s
    price = price_stream_fusion(_StubCost(EIGHT), _fused("colocate; stream_fusion=migrate_at:0,chunk:2"))
    parts = _by_label(price)
    assert parts["actor_gen"] == [(0, 0, 10.4), (1, 0, 10.4)]
    assert parts["ref_inf"] == [(0, 10.4, 11.4), (1, 10.4, 11.4)]
    assert price.seconds == pytest.approx(11.4) and price.migrate_at == 0


def test_the_migration_frees_a_device_for_scoring_while_the_tail_decodes():
    # at half the batch unfinished (step 2, 2.4 s) replica 1's two long samples move to replica 0 (the tie goes
    # to the lower replica); replica 0 re-prefills them over prompt + 2 tokens (0.2 s) and decodes the four for
    # 8 more steps (to 10.6 s). Device 1 scores the four short samples meanwhile (2.4-3.4 s); the last four
    # are scored 2 per replica (0.5 s): 11.1 s against 11.4 s.
    price = price_stream_fusion(_StubCost(EIGHT), _fused("colocate; stream_fusion=migrate_at:0.5,migrate_to:1,chunk:2"))
    parts = _by_label(price)
    assert parts["actor_gen"] == [(0, 0, 10.6), (1, 0, 2.4)]
    assert parts["migrate"] == [(0, 2.4, 2.4), (1, 2.4, 2.4)]
    assert parts["ref_inf"] == [(0, 10.6, 11.1), (1, 2.4, 3.4), (1, 10.6, 11.1)]
    assert price.seconds == pytest.approx(11.1)


def test_thresholds_that_leave_the_tail_where_it_is_change_nothing_and_auto_picks_the_best():
    cost = _StubCost(EIGHT)
    step = _fused("colocate; stream_fusion=migrate_at:auto,migrate_to:1,chunk:2")
    # below 4 of 8 unfinished the first qualifying step is the last one: nothing is left to move
    for r in (0.05, 0.1, 0.25, 0.4):
        assert price_stream_fusion(cost, step, r).seconds == pytest.approx(11.4)
    assert best_migrate_at(cost, step) == 0.5
    assert price_stream_fusion(cost, step).migrate_at == 0.5 and price_stream_fusion(
        cost, step
    ).seconds == pytest.approx(11.1)


def test_chunks_hand_samples_on_as_they_finish_to_devices_that_are_free():
    # a separated plan: scoring has its own device, so it runs from the first chunk on
    cluster = ClusterSpec.parse("cpu:2")
    schedule = build_schedule(GRPO, make_plan("separate:1; stream_fusion=migrate_at:0,chunk:1", GRPO, cluster))
    (step,) = [s for s in schedule if s.kind is StepKind.STREAM_FUSION]
    lengths = Workload(batch=2, prompt_len=4, response_lengths=(3, 9))
    price = price_stream_fusion(_StubCost(lengths), step)
    parts = _by_label(price)
    gen_device = step.members[0].alloc.devices
    ref_device = step.members[1].alloc.devices
    assert gen_device != ref_device
    # prefill 0.2 s; samples finish at 3.2 s and 9.2 s and are scored one by one, 0.25 s each
    assert parts["ref_inf"] == [(ref_device[0], 3.2, 3.45), (ref_device[0], 9.2, 9.45)]
    assert price.seconds == pytest.approx(9.45)


MEMORY = 24 * 2**30


def _real_cost(lengths, batch=64):
    shape = ModelShape(params=10_000_000, layers=4, hidden=256, heads=4, kv_heads=4, intermediate=688, vocab=4096)
    cluster = ClusterSpec.parse("cpu:2")
    return cluster, CostModel(
        cluster,
        PROFILES["local"],
        {r: shape for r in ("actor", "ref", "critic", "reward")},
        Workload(batch, 16, tuple(lengths)),
    )


def test_the_simulator_prices_a_fused_stage_and_draws_its_parts():
    long_tailed = [16] * 60 + [160] * 4
    cluster, cost = _real_cost(long_tailed)
    plan = make_plan("colocate; stream_fusion=migrate_at:0.2,migrate_to:1", PPO, cluster)
    plain = simulate(make_plan("colocate", PPO, cluster), PPO, cost, MEMORY)
    fused = simulate(plan, PPO, cost, MEMORY)
    step = next(s for s in build_schedule(PPO, plan) if s.kind is StepKind.STREAM_FUSION)
    price = cost.stream_fusion_stage(step)
    first = [i for i in fused.timeline if i.iteration == 0]
    drawn = [i for i in first if i.label in {label for label, *_ in price.parts}]
    assert {i.label for i in drawn} == {"actor_gen", "ref_inf", "critic_inf", "reward_inf", "migrate"}
    assert {i.kind for i in drawn if i.label == "actor_gen"} == {"generate"}
    assert max(i.end for i in drawn) - min(i.start for i in drawn) == pytest.approx(price.seconds)
    assert fused.iteration_time < plain.iteration_time  # the tail decodes on one device while the other scores


def test_fusion_never_makes_uniform_lengths_much_slower():
    # nothing to overlap when every sample ends together: the fused stage is generation then scoring
    cluster, cost = _real_cost([32] * 64)
    plain = simulate(make_plan("colocate", PPO, cluster), PPO, cost, MEMORY).iteration_time
    fused = simulate(
        make_plan("colocate; stream_fusion=migrate_at:auto", PPO, cluster), PPO, cost, MEMORY
    ).iteration_time
    assert fused == pytest.approx(plain, rel=0.05)
