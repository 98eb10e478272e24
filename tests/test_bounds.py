"""The lower bound on any plan's iteration time: hand-computed cases, and no simulated plan below it."""

import math
from types import SimpleNamespace

import pytest

from loomrl.algorithms.workflows import build_workflow
from loomrl.config import AlgoConfig, RolloutConfig
from loomrl.plan import GB, Allocation, ClusterSpec, colocate
from loomrl.planner.bounds import iteration_bound
from loomrl.planner.planning import compare_plans, model_config
from loomrl.planner.search import search
from loomrl.planner.simulator import simulate
from loomrl.planner.workload import Workload
from loomrl.workflow import MFC

PPO = build_workflow(AlgoConfig(name="ppo"), RolloutConfig())
CLUSTER = ClusterSpec.parse("cpu:4")
MEMORY = 24 * GB
CONFIGS = {role: SimpleNamespace(model_type="llama", hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=512, vocab_size=48)
           for role in ("actor", "critic", "ref", "reward")}


WORK = {"actor_gen": 8.0, "ref_inf": 2.0, "reward_inf": 2.0, "critic_inf": 2.0, "advantages": 0.0,
        "actor_train": 6.0, "critic_train": 6.0}


class ScalingCost:
    """Work spread evenly over the mesh; generation takes ``gen_fixed + gen_work / devices``; a trainable
    role holds ``trained`` bytes over its mesh, any other placement ``frozen`` bytes."""

    def __init__(self, gen_fixed: float = 0.0, gen_work: float = 8.0, trained: float = 0.0,
                 frozen: float = 0.0) -> None:
        self.gen_fixed, self.gen_work, self.trained, self.frozen = gen_fixed, gen_work, trained, frozen

    def mfc_time(self, mfc: MFC, alloc: Allocation) -> float:
        if mfc.name == "actor_gen":
            return self.gen_fixed + self.gen_work / len(alloc.mesh)
        return WORK[mfc.name] / len(alloc.mesh)

    def mfc_memory(self, mfc: MFC, alloc: Allocation, trainable: bool) -> float:
        return 0.0

    def static_memory(self, role: str, alloc: Allocation, trainable: bool) -> float:
        return (self.trained if trainable else self.frozen) / len(alloc.mesh)

    def realloc_time(self, role: str, src: Allocation, dst: Allocation) -> float:
        return 0.0


def test_perfectly_scaling_calls_are_bounded_by_their_work_which_colocation_reaches():
    cost = ScalingCost()
    bound = iteration_bound(PPO, CLUSTER, cost, MEMORY, CONFIGS)
    assert bound.seconds == pytest.approx(sum(WORK.values()) / 4)
    assert bound.work == pytest.approx(bound.seconds) and bound.limit == "work"
    assert simulate(colocate(PPO, CLUSTER), PPO, cost, MEMORY).iteration_time == pytest.approx(bound.seconds)


def test_generation_that_does_not_scale_is_bounded_by_its_cycle():
    # Generation takes 8 s on any mesh. The cycle actor_gen -> one inference -> advantages -> actor_train runs
    # once per iteration: 8 + 2/4 + 0 + 6/4 = 10 s with every call on all 4 devices; the work (8/4 at best for
    # generation on one device, plus 18/4) is less.
    cost = ScalingCost(gen_fixed=8.0, gen_work=0.0)
    bound = iteration_bound(PPO, CLUSTER, cost, MEMORY, CONFIGS)
    assert bound.seconds == pytest.approx(10.0)
    assert bound.cycle == pytest.approx(10.0) and bound.work == pytest.approx(2.0 + 18.0 / 4)
    assert bound.limit == "cycle" and bound.weight == 1.0
    assert bound.path[0] == "actor_gen" and bound.path[-1] == "actor_train"


def test_the_weighted_bound_beats_both_pure_bounds():
    # Generation takes 4 + 4/n s on n devices: (8 s, 2 device-s per device of the cluster) on 1 device,
    # (6, 3) on 2, (5, 5) on 4. For weight w of the cycle, the other calls give 0.5 + 1.5 on the cycle and
    # (1 - w)(0.5 + 0.5 + 1.5) off it, so the bound is max over w of min(6.5 + 3.5w, 7.5 + 0.5w, 9.5 - 2.5w):
    # 47/6 at w = 2/3 (the grid of weights gets within its step), above the work bound (6.5) and the cycle (7).
    cost = ScalingCost(gen_fixed=4.0, gen_work=4.0)
    bound = iteration_bound(PPO, CLUSTER, cost, MEMORY, CONFIGS)
    assert bound.work == pytest.approx(6.5) and bound.cycle == pytest.approx(7.0)
    assert bound.seconds == pytest.approx(47 / 6, abs=3e-3) and bound.seconds <= 47 / 6
    assert bound.weight == pytest.approx(2 / 3, abs=0.01)
    for plan, result in search(PPO, CLUSTER, cost, MEMORY, CONFIGS, seed=0, time_budget_s=60, chains=2,
                               max_steps=150, top_k=3):
        assert result.iteration_time >= bound.seconds - 1e-9, plan.text


def test_only_allocations_that_fit_count():
    # As above, but 50 GB of weights fit a 24 GB device only on 4 devices: generation's only choice is (5, 5),
    # so the bound is max over w of 5 + 2 + 2.5(1 - w): the work, 9.5 s, that colocating everything takes.
    cost = ScalingCost(gen_fixed=4.0, gen_work=4.0, frozen=50 * GB)
    bound = iteration_bound(PPO, CLUSTER, cost, MEMORY, CONFIGS)
    assert bound.seconds == pytest.approx(9.5) and bound.weight == 0.0 and bound.limit == "work"
    # 30 GB fit on 2 devices: generation's (6, 3) is back, and with it the bound of 47/6 s.
    cost = ScalingCost(gen_fixed=4.0, gen_work=4.0, frozen=30 * GB)
    assert iteration_bound(PPO, CLUSTER, cost, MEMORY, CONFIGS).seconds == pytest.approx(47 / 6, abs=3e-3)
    # 100 GB of training state fit nowhere: no plan fits, and the bound says so.
    assert math.isinf(iteration_bound(PPO, CLUSTER, ScalingCost(trained=100 * GB), MEMORY, CONFIGS).seconds)


def test_training_states_that_fit_only_apart_fit_no_plan():
    # Actor and critic each keep 60 GB of training state, which fits the 4 devices of 24 GB (15 GB each) alone
    # but not beside the other's 60 GB (120 GB > 96 GB): every plan overflows, and the bound says so; at 40 GB
    # each (80 GB) both fit, and the bound is the work again.
    assert math.isinf(iteration_bound(PPO, CLUSTER, ScalingCost(trained=60 * GB), MEMORY, CONFIGS).seconds)
    assert iteration_bound(PPO, CLUSTER, ScalingCost(trained=40 * GB), MEMORY, CONFIGS).seconds == pytest.approx(
        sum(WORK.values()) / 4)
    assert not simulate(colocate(PPO, CLUSTER), PPO, ScalingCost(trained=60 * GB), MEMORY).feasible


def test_no_simulated_plan_of_the_cost_model_is_below_the_bound():
    workflow = build_workflow(AlgoConfig(name="ppo", ppo_epochs=1, minibatches=4), RolloutConfig())
    cluster = ClusterSpec.parse("h100:1x8")
    configs = {role: model_config("llama2-7b") for role in workflow.roles()}
    workload = Workload(batch=512, prompt_len=128, response_lengths=(128,), ppo_epochs=1, minibatches=4)
    report = compare_plans(workflow, cluster, configs, workload, seed=0, time_budget_s=8)
    bound = report.bound.seconds
    assert 0 < bound < math.inf
    times = [r.iteration_time for _, r in report.heuristics.values() if r.feasible]
    times += [r.iteration_time for _, r in report.searched]
    assert len(times) >= 3 and min(times) >= bound
    assert min(times) < 1.5 * bound  # not a vacuous bound: the best plan found is within 50% of it
