"""The lower bound on any plan's iteration time: segments, hand-computed cases, and no simulated plan below it."""

import math
from types import SimpleNamespace

import pytest

from loomrl.algorithms.workflows import build_workflow
from loomrl.config.schema import AlgoConfig, RolloutConfig
from loomrl.models.presets import model_config
from loomrl.plan import GB, Allocation, ClusterSpec, colocate
from loomrl.plan.cluster import profile_for
from loomrl.planner.cost.estimator import CostEstimator
from loomrl.planner.cost.workload import Workload
from loomrl.planner.inputs import PlannerInputs
from loomrl.planner.planning import compare_plans
from loomrl.planner.search import bounds
from loomrl.planner.search.bounds import iteration_bound, segment_seconds, segments
from loomrl.planner.search.search import search
from loomrl.planner.simulation.simulator import simulate
from loomrl.workflow import MFC

PPO = build_workflow(AlgoConfig(name="ppo"), RolloutConfig())
CLUSTER = ClusterSpec.parse("cpu:4")
MEMORY = 24 * GB
CONFIGS = {
    role: SimpleNamespace(
        model_type="llama",
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        vocab_size=48,
    )
    for role in ("actor", "critic", "ref", "reward")
}


WORK = {
    "actor_gen": 8.0,
    "ref_inf": 2.0,
    "reward_inf": 2.0,
    "critic_inf": 2.0,
    "advantages": 0.0,
    "actor_train": 6.0,
    "critic_train": 6.0,
}


class ScalingCost(CostEstimator):
    """Call ``c`` takes ``fixed[c] + WORK[c] / devices`` (``fixed`` 0 unless given: work spread evenly over the
    mesh); a trainable role holds ``states[role]`` bytes over its mesh, any other placement ``frozen`` bytes."""

    def __init__(
        self,
        fixed: dict[str, float] | None = None,
        states: dict[str, float] | None = None,
        frozen: float = 0.0,
        work: dict[str, float] | None = None,
    ) -> None:
        self.fixed, self.states, self.frozen = fixed or {}, states or {}, frozen
        self.work = {**WORK, **(work or {})}

    def mfc_time(self, mfc: MFC, alloc: Allocation) -> float:
        return self.fixed.get(mfc.name, 0.0) + self.work[mfc.name] / len(alloc.mesh)

    def mfc_memory(self, mfc: MFC, alloc: Allocation, trainable: bool) -> float:
        return 0.0

    def static_memory(self, role: str, alloc: Allocation, trainable: bool) -> float:
        return (self.states.get(role, 0.0) if trainable else self.frozen) / len(alloc.mesh)

    def realloc_time(self, role: str, src: Allocation, dst: Allocation) -> float:
        return 0.0


def test_ppo_runs_in_four_segments_split_at_generation_and_advantages():
    assert segments(PPO) == [
        ("actor_gen",),
        ("ref_inf", "reward_inf", "critic_inf"),
        ("advantages",),
        ("actor_train", "critic_train"),
    ]
    grpo = build_workflow(AlgoConfig(name="grpo"), RolloutConfig())
    assert segments(grpo)[0] == ("actor_gen",) and segments(grpo)[-1] == ("actor_train",)


def test_perfectly_scaling_calls_are_bounded_by_their_work_which_colocation_reaches():
    cost = ScalingCost()
    bound = iteration_bound(PPO, CLUSTER, cost, MEMORY, CONFIGS)
    assert bound.seconds == pytest.approx(sum(WORK.values()) / 4)
    assert simulate(colocate(PPO, CLUSTER), PPO, cost, MEMORY).iteration_time == pytest.approx(bound.seconds)
    assert len(bound.training) == 2 and bound.training[0].startswith("actor=")


def test_generation_that_does_not_scale_runs_alone_before_everything_else():
    # Generation takes 8 s on any mesh, and nothing of its iteration can run beside it (everything reads its
    # output), nor anything of the next (iterations run one after another). So the bound is 8 s plus the rest's
    # work, 6/4 + 12/4: colocation's 12.5 s. (A whole-iteration bound gave 10: the longest path 8 + 2/4 + 0 +
    # 6/4.)
    cost = ScalingCost(fixed={"actor_gen": 8.0}, work={"actor_gen": 0.0})
    bound = iteration_bound(PPO, CLUSTER, cost, MEMORY, CONFIGS)
    assert bound.seconds == pytest.approx(12.5)
    first = bound.segments[0]
    assert first.calls == ("actor_gen",) and first.seconds == pytest.approx(8.0) and first.limit == "path"
    assert bound.segments[1].limit == "work"
    result = simulate(colocate(PPO, CLUSTER), PPO, cost, MEMORY)
    assert result.iteration_time == pytest.approx(12.5)
    # colocation takes each segment's bound: generation alone, then each other segment's work on all devices
    parts = [s.calls for s in bound.segments]
    assert segment_seconds(result, parts) == pytest.approx([s.seconds for s in bound.segments])
    assert segment_seconds(result, parts) == pytest.approx([8.0, 1.5, 0.0, 3.0])


def test_the_weighted_bound_beats_both_pure_bounds():
    # The reference model's inference takes 4 + 4/n s on n devices: (8 s, 2 device-s per device of the cluster)
    # on 1 device, (6, 3) on 2, (5, 5) on 4; the other two inferences 2/n. On the path through ref_inf, with
    # weight w, ref_inf gives min(2 + 6w, 3 + 3w, 5) and each other inference (1 - w)/2, so the inference
    # segment's bound is max over w of min(3 + 5w, 4 + 2w, 6 - w): 16/3 at w = 2/3, above its work (3) and its
    # longest path (5). Generation adds 8/4 and training 12/4.
    cost = ScalingCost(fixed={"ref_inf": 4.0}, work={"ref_inf": 4.0})
    bound = iteration_bound(PPO, CLUSTER, cost, MEMORY, CONFIGS)
    inference = bound.segments[1]
    assert inference.calls == ("ref_inf", "reward_inf", "critic_inf") and inference.limit == "both"
    assert inference.seconds == pytest.approx(16 / 3, abs=5e-3) and inference.seconds <= 16 / 3
    assert inference.weight == pytest.approx(2 / 3, abs=0.01) and inference.path == ("ref_inf",)
    assert bound.seconds == pytest.approx(2 + 16 / 3 + 3, abs=5e-3)
    # the best plans take 2 + 6 + 3 s: ref_inf on two devices beside the other two inferences, or on all four
    for plan, result in search(
        PPO, CLUSTER, cost, MEMORY, CONFIGS, seed=0, time_budget_s=60, chains=2, max_steps=150, top_k=3
    ):
        assert result.iteration_time >= bound.seconds - 1e-9, plan.text


# Both train calls take 4 + 4/n s on n devices: 8 s on one, 6 on two, 5 on four.
TRAINS_DO_NOT_SCALE = {"actor_train": 4.0, "critic_train": 4.0}
TRAIN_WORK = {"actor_train": 4.0, "critic_train": 4.0}


def test_a_training_placement_fixes_the_train_segment_and_what_fits_beside_it():
    # 10 GB of training state each fit anywhere: actor and critic train side by side on two devices each, 6 s,
    # the busiest device's time for that placement and no more for any other.
    cost = ScalingCost(fixed=TRAINS_DO_NOT_SCALE, work=TRAIN_WORK, states={"actor": 10 * GB, "critic": 10 * GB})
    bound = iteration_bound(PPO, CLUSTER, cost, MEMORY, CONFIGS)
    assert bound.segments[-1].seconds == pytest.approx(6.0)
    assert bound.seconds == pytest.approx(2 + 1.5 + 6)
    # The critic's 80 GB fit the 24 GB devices only on all four (20 GB each), and beside them the actor's 10 GB
    # only on all four too (2.5 GB each; 5 GB on two would make 25): the two train calls run in turn, 5 + 5 s.
    cost = ScalingCost(fixed=TRAINS_DO_NOT_SCALE, work=TRAIN_WORK, states={"actor": 10 * GB, "critic": 80 * GB})
    bound = iteration_bound(PPO, CLUSTER, cost, MEMORY, CONFIGS)
    train = bound.segments[-1]
    assert train.seconds == pytest.approx(10.0)  # = their work on all four devices, too
    assert [t.split(":")[0] for t in bound.training] == ["actor=0-3", "critic=0-3"]
    assert simulate(colocate(PPO, CLUSTER), PPO, cost, MEMORY).iteration_time == pytest.approx(bound.seconds)
    # Without enumerating placements, each train call counts only its own fit beside the other's state at its
    # smallest: the actor may then take two devices, and the segment's bound falls to max over w of
    # min(7 + w, 8 - 2w, 10 - 5w) = 22/3 at w = 1/3. Valid, and looser.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bounds, "PLACEMENTS", 0)
        loose = iteration_bound(PPO, CLUSTER, cost, MEMORY, CONFIGS)
    assert loose.training == () and loose.segments[-1].seconds == pytest.approx(22 / 3, abs=5e-3)
    # 100 GB of training state fit nowhere: no plan fits, and the bound says so.
    assert math.isinf(iteration_bound(PPO, CLUSTER, ScalingCost(states={"critic": 100 * GB}), MEMORY, CONFIGS).seconds)


def test_training_states_that_fit_only_apart_fit_no_plan():
    # Actor and critic each keep 60 GB of training state, which fits the 4 devices of 24 GB (15 GB each) alone
    # but not beside the other's 60 GB (120 GB > 96 GB): every plan overflows, and the bound says so, with its
    # placements enumerated or not; at 40 GB each (80 GB) both fit, and the bound is the work again.
    big = {"actor": 60 * GB, "critic": 60 * GB}
    assert math.isinf(iteration_bound(PPO, CLUSTER, ScalingCost(states=big), MEMORY, CONFIGS).seconds)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bounds, "PLACEMENTS", 0)
        assert math.isinf(iteration_bound(PPO, CLUSTER, ScalingCost(states=big), MEMORY, CONFIGS).seconds)
    fits = ScalingCost(states={"actor": 40 * GB, "critic": 40 * GB})
    assert iteration_bound(PPO, CLUSTER, fits, MEMORY, CONFIGS).seconds == pytest.approx(sum(WORK.values()) / 4)
    assert not simulate(colocate(PPO, CLUSTER), PPO, ScalingCost(states=big), MEMORY).feasible


def test_no_simulated_plan_of_the_cost_model_is_below_the_bound():
    workflow = build_workflow(AlgoConfig(name="ppo", ppo_epochs=1, minibatches=4), RolloutConfig())
    cluster = ClusterSpec.parse("h100:1x8")
    configs = {role: model_config("llama2-7b") for role in workflow.roles()}
    workload = Workload(batch=512, prompt_len=128, response_lengths=(128,), ppo_epochs=1, minibatches=4)
    report = compare_plans(
        PlannerInputs(workflow, cluster, profile_for(cluster), configs, workload), seed=0, search_steps=40
    )
    bound = report.bound.seconds
    assert 0 < bound < math.inf
    times = [r.iteration_time for _, r in report.heuristics.values() if r.feasible]
    times += [r.iteration_time for _, r in report.searched]
    assert len(times) >= 3 and min(times) >= bound
    assert min(times) < 1.1 * bound  # not a vacuous bound: the best plan found is within 10% of it
    # segment by segment too: each segment of a plan takes at least its bound, and together the iteration
    parts = [s.calls for s in report.bound.segments]
    for _, result in [*report.heuristics.values(), *report.searched]:
        seconds = segment_seconds(result, parts)
        assert sum(seconds) == pytest.approx(result.iteration_time)
        assert all(t >= s.seconds - 1e-9 for t, s in zip(seconds, report.bound.segments))
