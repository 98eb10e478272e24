"""Intra-stage fusion as a plan choice: reversed pipeline layouts, the ``pipeline_fusion`` knob and its checks, the
``fused_train`` schedule step, its price, and the search choosing it (:mod:`loomrl.plan`,
:mod:`loomrl.planner.cost.pipeline_fusion`)."""

from __future__ import annotations

import dataclasses

import pytest

from loomrl.algorithms.workflows import build_workflow
from loomrl.config.schema import AlgoConfig, RolloutConfig
from loomrl.errors import ConfigError
from loomrl.models.presets import model_config
from loomrl.plan import ClusterSpec
from loomrl.plan.allocation import Allocation
from loomrl.plan.cluster import profile_for
from loomrl.plan.layout import Coords, Layout
from loomrl.plan.model_shape import ModelShape
from loomrl.plan.plan import ExecutionPlan
from loomrl.plan.plan_string import format_plan_string, parse_plan_string
from loomrl.plan.schedule import StepKind, build_schedule
from loomrl.planner.cost.model import CostModel
from loomrl.planner.cost.pipeline_fusion import pipeline_fusion_problem, price_pipeline_fusion
from loomrl.planner.cost.workload import Workload
from loomrl.planner.search.evaluate import Evaluator as _Evaluator
from loomrl.planner.search.search import pipeline_fusion_twin, search
from loomrl.planner.simulation.simulator import simulate

PPO = build_workflow(AlgoConfig(name="ppo", minibatches=2), RolloutConfig())
GRPO = build_workflow(AlgoConfig(name="grpo"), RolloutConfig())
CPU4 = ClusterSpec(nodes=1, devices_per_node=4)
STREAM_FUSION = (
    "actor_gen=0-3; ref_inf=0-3; reward_inf=0-3; critic_inf=0-3; actor_train=0-3:pp4mb4; "
    "critic_train=0-3:dp2pp2revmb2; pipeline_fusion=on"
)


def test_a_reversed_layout_numbers_stages_from_the_meshs_end():
    layout = Layout(dp=2, pp=2, reverse=True)
    assert [layout.coords(r) for r in range(4)] == [Coords(1, 0, 0), Coords(1, 1, 0), Coords(0, 0, 0), Coords(0, 1, 0)]
    assert all(layout.rank(layout.coords(r)) == r for r in range(4))
    alloc = Allocation.parse("4-7:dp2pp2rev")
    assert alloc.layout == layout and alloc.text == "4-7:dp2pp2rev"
    assert alloc.device(Coords(0, 0, 0)) == 6 and alloc.coords(4) == Coords(1, 0, 0)
    assert Layout(pp=1, reverse=True) == Layout()  # one stage has no direction
    with pytest.raises(ConfigError, match="rev needs pp > 1"):
        Allocation.parse("0-1:dp2rev")


def test_fuse_train_reads_writes_and_round_trips():
    plan = parse_plan_string(STREAM_FUSION, PPO, CPU4)
    assert plan.pipeline_fusion and plan["critic_train"].layout.reverse
    assert "pipeline_fusion=on" in format_plan_string(plan, PPO)
    assert parse_plan_string(format_plan_string(plan, PPO), PPO, CPU4) == plan
    assert ExecutionPlan.from_dict(plan.to_dict()) == plan
    assert not parse_plan_string(STREAM_FUSION.replace("=on", "=off"), PPO, CPU4).pipeline_fusion
    with pytest.raises(ConfigError, match="pipeline_fusion is on or off"):
        parse_plan_string(STREAM_FUSION.replace("=on", "=yes"), PPO, CPU4)


@pytest.mark.parametrize(
    "change, message",
    [
        ("critic_train=0-1:pp2", "needs the same devices"),
        ("critic_train=0-3:dp4", "is not a pipeline"),
        ("critic_train=0-3:tp2pp2", "is not a pipeline"),
    ],
)
def test_fuse_train_needs_two_pipelines_on_the_same_devices(change, message):
    text = STREAM_FUSION.replace("critic_train=0-3:dp2pp2revmb2", change)
    with pytest.raises(ConfigError, match=message):
        parse_plan_string(text, PPO, CPU4)


def test_fuse_train_needs_two_train_calls():
    text = "actor_gen=0-3; ref_inf=0-3; reward_inf=0-3; actor_train=0-3:pp4; pipeline_fusion=on"
    with pytest.raises(ConfigError, match="two independent train calls"):
        parse_plan_string(text, GRPO, CPU4)


def test_the_schedule_runs_the_train_calls_as_one_stage():
    plan = parse_plan_string(STREAM_FUSION, PPO, CPU4)
    schedule = build_schedule(PPO, plan)
    stage = schedule["pipeline_fusion_actor_train"]
    assert stage.kind is StepKind.PIPELINE_FUSION and [m.id for m in stage.members] == ["actor_train", "critic_train"]
    assert stage.devices == (0, 1, 2, 3) and "advantages" in stage.deps
    assert set(stage.deps) == {d for m in stage.members for d in m.deps}  # what either call waited for
    assert "actor_train" not in [s.id for s in schedule] and [c.id for c in schedule.calls()][-2:] == [
        "actor_train",
        "critic_train",
    ]
    unfused = build_schedule(PPO, dataclasses.replace(plan, pipeline_fusion=False))
    assert {"actor_train", "critic_train"} <= {s.id for s in unfused}


def test_the_problem_takes_each_allocations_placement():
    actor, critic = Allocation.parse("0-3:pp4mb4"), Allocation.parse("0-3:dp2pp2revmb2")
    from loomrl.plan.pipeline_fusion import PipelineSpec

    problem = pipeline_fusion_problem(actor, critic, (PipelineSpec(4, 4), PipelineSpec(2, 4)))
    assert [problem.device_of(0, 0, s) for s in range(4)] == [0, 1, 2, 3]
    # the critic's replica 0 holds stage 0 on device 2 and stage 1 on device 0 (dp is the faster rank digit)
    assert [problem.device_of(1, 0, s) for s in range(2)] == [2, 0]
    assert [problem.device_of(1, 1, s) for s in range(2)] == [3, 1]
    assert problem.stage_on(1, 1) == (1, 1)


def _gpu_cost(plan: ExecutionPlan, batch: int = 256):
    cluster = plan.cluster
    shapes = {role: ModelShape.from_config(model_config("llama2-7b")) for role in PPO.roles()}
    workload = Workload(batch=batch, prompt_len=256, response_lengths=(256,), minibatches=2)
    return CostModel(cluster, profile_for(cluster), shapes, workload)


def test_a_fused_stage_costs_less_than_its_two_pipelines_and_no_less_than_its_bound():
    cluster = ClusterSpec.parse("h100:1x8")
    text = (
        "actor_gen=0-7:dp8; ref_inf=0-7:dp8; reward_inf=0-7:dp8; critic_inf=0-7:dp8; "
        "actor_train=0-7:pp8mb4; critic_train=0-7:pp8revmb4; pipeline_fusion=on"
    )
    plan = parse_plan_string(text, PPO, cluster)
    cost = _gpu_cost(plan)
    stage = build_schedule(PPO, plan)["pipeline_fusion_actor_train"]
    price = price_pipeline_fusion(cost, stage)
    separate = sum(cost.mfc_time(m.mfc, m.alloc) for m in stage.members)
    assert price.seconds < separate
    assert price.bound_s <= price.fused_step_s * (1 + 1e-12) and price.fused_step_s < price.separate_step_s
    fused = simulate(plan, PPO, cost, cluster.memory_gb * 2**30)
    unfused = simulate(pipeline_fusion_twin(plan, _Evaluator(PPO, cost, 1e12, 1)), PPO, cost, cluster.memory_gb * 2**30)
    assert fused.iteration_time < unfused.iteration_time


def test_the_twin_fuses_and_unfuses_with_the_second_pipeline_reversed():
    plan = parse_plan_string(STREAM_FUSION, PPO, CPU4)
    evaluate = _Evaluator(PPO, _gpu_cost(plan), 1e12, 1)
    unfused = pipeline_fusion_twin(plan, evaluate)
    assert not unfused.pipeline_fusion and unfused["critic_train"].text == "0-3:dp2pp2mb2"
    again = pipeline_fusion_twin(unfused, evaluate)
    assert again == plan
    data_parallel = dataclasses.replace(
        unfused, allocations={**unfused.allocations, "critic_train": Allocation.parse("0-3:dp4")}
    )
    assert pipeline_fusion_twin(data_parallel, evaluate) is None


def test_the_search_fuses_training_where_bubbles_dominate():
    """Many stages and few micro-batches: each pipeline alone idles most of the time, and the search, started
    from the unfused plan, ends on the fused one."""
    cluster = ClusterSpec.parse("h100:1x8")
    text = (
        "actor_gen=0-7:dp8; ref_inf=0-7:dp8; reward_inf=0-7:dp8; critic_inf=0-7:dp8; "
        "actor_train=0-7:pp8mb2; critic_train=0-7:pp8mb2"
    )
    start = parse_plan_string(text, PPO, cluster)
    cost = _gpu_cost(start, batch=64)
    (best, _), *_ = search(
        PPO,
        cluster,
        cost,
        cluster.memory_gb * 2**30,
        {r: model_config("llama2-7b") for r in PPO.roles()},
        seed=0,
        time_budget_s=20,
        chains=1,
        start=start,
        max_steps=0,
    )
    assert best.pipeline_fusion and best["critic_train"].layout.reverse


def test_the_lower_bound_holds_for_fused_plans():
    """A fused train stage fills its pipelines' bubbles, so the bound counts each train call's devices busy for
    its time without its bubble: no fused plan beats it."""
    from loomrl.planner.search.bounds import iteration_bound

    cluster = ClusterSpec.parse("h100:1x8")
    configs = {r: model_config("llama2-7b") for r in PPO.roles()}
    text = (
        "actor_gen=0-7:dp8; ref_inf=0-7:dp8; reward_inf=0-7:dp8; critic_inf=0-7:dp8; "
        "actor_train=0-7:pp8mb2; critic_train=0-7:pp8revmb2; pipeline_fusion=on"
    )
    plan = parse_plan_string(text, PPO, cluster)
    cost = _gpu_cost(plan, batch=64)
    fused = simulate(plan, PPO, cost, cluster.memory_gb * 2**30)
    bound = iteration_bound(PPO, cluster, cost, cluster.memory_gb * 2**30, configs)
    assert fused.feasible and bound.seconds <= fused.iteration_time
