"""Plan search and the heuristic baselines on the PPO workflow, with a small layout-aware fake cost model.

The fake model rewards spreading work over devices but charges tensor-parallel communication, data-parallel
gradient sync and pipeline bubbles (fewer with more micro-batches), and fills memory so that pure data
parallelism of the trained roles on every device does not fit: the search has something to find.
"""

from types import SimpleNamespace

import pytest

from loomrl.algorithms.workflows import build_workflow
from loomrl.config.schema import AlgoConfig, RolloutConfig
from loomrl.errors import ConfigError
from loomrl.plan import GB, Allocation, ClusterSpec, DeviceSet, ExecutionPlan, colocate
from loomrl.plan.layout import Layout
from loomrl.planner.cost.estimator import CostEstimator
from loomrl.planner.search.candidates import MICRO_BATCHES, candidate_allocations, device_meshes, layouts_on, unit_names
from loomrl.planner.search.candidates import Unit as _Unit
from loomrl.planner.search.evaluate import plan_key
from loomrl.planner.search.heuristics import best_heuristic_plans
from loomrl.planner.search.search import _crossovers, _Splitter, search
from loomrl.planner.simulation.simulator import simulate
from loomrl.workflow import MFC, MFCKind

PPO = build_workflow(AlgoConfig(name="ppo"), RolloutConfig())
CLUSTER = ClusterSpec.parse("h100:4")  # accelerators: frozen roles sharing devices are offloaded (reloads free here)
MEMORY = 24 * GB


def llama(heads: int = 4, kv_heads: int = 2, layers: int = 4) -> SimpleNamespace:
    return SimpleNamespace(
        model_type="llama",
        hidden_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=512,
        vocab_size=48,
    )


CONFIGS = {role: llama() for role in ("actor", "critic", "ref", "reward")}


class LayoutCost(CostEstimator):
    """Work over devices, plus tp/dp communication and pipeline bubbles; memory sharded by tp·pp."""

    WORK = {
        "actor_gen": 8.0,
        "ref_inf": 2.0,
        "reward_inf": 2.0,
        "critic_inf": 2.0,
        "advantages": 0.1,
        "actor_train": 6.0,
        "critic_train": 6.0,
    }

    def mfc_time(self, mfc: MFC, alloc: Allocation) -> float:
        lay = alloc.layout
        seconds = self.WORK[mfc.name] / len(alloc.mesh) + 0.05 * (lay.tp - 1) + 0.02 * (lay.dp - 1)
        if lay.pp > 1:
            seconds *= (alloc.micro_batches + lay.pp - 1) / alloc.micro_batches
        return seconds

    def mfc_memory(self, mfc: MFC, alloc: Allocation, trainable: bool) -> float:
        return (4 if trainable else 1) * GB / (alloc.layout.dp * alloc.micro_batches)

    def static_memory(self, role: str, alloc: Allocation, trainable: bool) -> float:
        return (4 if trainable else 1) * 3 * GB / (alloc.layout.tp * alloc.layout.pp)

    def realloc_time(self, role: str, src: Allocation, dst: Allocation) -> float:
        return 0.1


def test_device_meshes_are_aligned_powers_of_two_and_whole_nodes():
    meshes = [m.text for m in device_meshes(ClusterSpec.parse("cpu:2x4"))]
    assert meshes == ["0", "1", "2", "3", "4", "5", "6", "7", "0-1", "2-3", "4-5", "6-7", "0-3", "4-7", "0-7"]
    assert [m.text for m in device_meshes(ClusterSpec.parse("cpu:3"))] == ["0", "1", "2", "0-1", "0-2"]
    assert len(device_meshes(ClusterSpec.parse("h100:8x8"))) == 8 * (8 + 4 + 2 + 1) + 4 + 2 + 1


def test_layouts_fit_the_model_and_keep_tensor_parallel_groups_in_a_node():
    cluster = ClusterSpec.parse("cpu:2x4")
    whole = DeviceSet(tuple(range(8)))
    train = PPO["actor_train"]
    # heads 4, kv heads 2 → tp ∈ {1, 2}; layers 4 → pp ∈ {1, 2, 4}, combined with either tp.
    assert layouts_on(train, whole, cluster, llama()) == [
        Layout(8),
        Layout(4, 1, 2),
        Layout(2, 1, 4),
        Layout(4, 2),
        Layout(2, 2, 2),
        Layout(1, 2, 4),
    ]
    assert layouts_on(PPO["actor_gen"], whole, cluster, llama()) == [Layout(8), Layout(4, 2)]  # no pp for generation
    assert Layout(2, 4) in layouts_on(train, whole, cluster, llama(heads=8, kv_heads=8))
    assert Layout(1, 8) not in layouts_on(train, whole, cluster, llama(heads=8, kv_heads=8))  # tp > devices per node
    # A mesh straddling nodes 0 and 1 (devices 3, 4) cannot hold a tp=2 group.
    assert layouts_on(train, DeviceSet((3, 4)), cluster, llama()) == [Layout(2), Layout(1, 1, 2)]
    gpt2 = SimpleNamespace(model_type="gpt2", num_hidden_layers=4, num_attention_heads=4)
    assert layouts_on(train, whole, cluster, gpt2) == [Layout(8)]


def test_candidate_allocations():
    cluster = ClusterSpec.parse("cpu:2x4")
    train = candidate_allocations(PPO["actor_train"], PPO, cluster, CONFIGS)
    assert len(train) == len({a.text for a in train})
    assert {a.micro_batches for a in train} == set(MICRO_BATCHES)
    assert Allocation.parse("0-7:dp4pp2mb8") in train and Allocation.parse("4-7:dp2tp2mb2") in train
    assert all(a.layout.tp <= cluster.devices_per_node and len(a.mesh) & (len(a.mesh) - 1) == 0 for a in train)
    gen = candidate_allocations(PPO["actor_gen"], PPO, cluster, CONFIGS)
    assert all(a.micro_batches == 1 and a.layout.pp == 1 for a in gen)
    assert len(gen) == 8 * 1 + 4 * 2 + 2 * 2 + 1 * 2  # sizes 1, 2, 4, 8 with tp ∈ {1, 2} from size 2 on
    advantages = candidate_allocations(PPO["advantages"], PPO, cluster, CONFIGS)
    assert [a.text for a in advantages] == [f"{d}:dp1" for d in range(8)]
    with pytest.raises(ConfigError, match="no config for role 'critic'"):
        candidate_allocations(PPO["critic_inf"], PPO, cluster, {"actor": llama()})


def test_the_fake_model_makes_pure_data_parallel_colocation_infeasible():
    result = simulate(colocate(PPO, CLUSTER), PPO, LayoutCost(), MEMORY)
    assert not result.feasible and "device 0 needs" in result.reason


def test_interleaving_moves_reach_what_single_moves_cannot():
    # From the best heuristic (every call on 0-3), moving the reference's or the reward model's inference alone
    # onto half the devices is uphill (the other still waits for all four), so coordinate descent alone stays
    # at 6.98 s; the interleaving move puts both on the halves, each on its fastest layout there: ref on 0-1,
    # reward on 2-3, 1.02 s side by side instead of 2 × 0.56 s one after the other, 6.88 s.
    heuristics = best_heuristic_plans(PPO, CLUSTER, LayoutCost(), MEMORY, CONFIGS)
    start, start_result = min(heuristics.values(), key=lambda pr: pr[1].iteration_time)
    assert start_result.iteration_time == pytest.approx(6.98)
    polished = search(
        PPO, CLUSTER, LayoutCost(), MEMORY, CONFIGS, seed=0, time_budget_s=300, chains=1, max_steps=0, start=start
    )  # no annealing: the polish alone
    best = polished[0][0]
    assert polished[0][1].iteration_time == pytest.approx(6.88)
    assert (best["ref_inf"].text, best["reward_inf"].text) == ("0-1:dp2", "2-3:dp2")
    units = [
        _Unit(names, tuple(candidate_allocations(PPO[names[0]], PPO, CLUSTER, CONFIGS))) for names in unit_names(PPO)
    ]
    splitter = _Splitter(units, PPO, LayoutCost(), MEMORY)
    pairs = {(units[i].names, units[j].names) for i, j in splitter.pairs}
    assert (("ref_inf",), ("reward_inf",)) in pairs and (("actor_train",), ("critic_train",)) in pairs
    assert (("actor_gen",), ("ref_inf",)) not in pairs  # the reference reads what generation wrote
    i, j = (next(k for k, u in enumerate(units) if u.names == (name,)) for name in ("ref_inf", "reward_inf"))
    moved = splitter.moves(start, i, j)
    assert [(p["ref_inf"].mesh.text, p["reward_inf"].mesh.text) for p in moved] == [("0-1", "2-3"), ("2-3", "0-1")]
    back = splitter.moves(best, i, j)  # from the halves: both halves of 0-1, both of 2-3, and both back on 0-3
    assert [(p["ref_inf"].mesh.text, p["reward_inf"].mesh.text) for p in back][-1] == ("0-3", "0-3")


def test_search_is_deterministic_for_a_seed():
    runs = [
        search(PPO, CLUSTER, LayoutCost(), MEMORY, CONFIGS, seed=7, time_budget_s=300, chains=2, max_steps=60)
        for _ in range(2)
    ]
    assert [plan_key(p) for p, _ in runs[0]] == [plan_key(p) for p, _ in runs[1]]
    assert [r.iteration_time for _, r in runs[0]] == [r.iteration_time for _, r in runs[1]]
    assert runs[0], "the search found no feasible plan"


def test_search_top_k_is_distinct_sorted_and_feasible():
    found = search(
        PPO, CLUSTER, LayoutCost(), MEMORY, CONFIGS, seed=1, time_budget_s=300, chains=2, top_k=4, max_steps=80
    )
    assert len(found) == 4
    assert len({plan_key(p) for p, _ in found}) == 4
    times = [r.iteration_time for _, r in found]
    assert times == sorted(times)
    for plan, result in found:
        assert result.feasible
        plan.validate(PPO, CONFIGS)
        assert simulate(plan, PPO, LayoutCost(), MEMORY).iteration_time == result.iteration_time


def test_search_is_at_least_as_good_as_its_start_and_beats_the_heuristics_here():
    heuristics = best_heuristic_plans(PPO, CLUSTER, LayoutCost(), MEMORY, CONFIGS)
    assert set(heuristics) == {"colocate", "interleave", "separate"}
    for name, (plan, result) in heuristics.items():
        assert result.feasible, (name, result.reason)
        plan.validate(PPO, CONFIGS)
    start, start_result = min(heuristics.values(), key=lambda pr: pr[1].iteration_time)
    found = search(
        PPO, CLUSTER, LayoutCost(), MEMORY, CONFIGS, seed=0, time_budget_s=300, chains=4, max_steps=300, start=start
    )
    assert found[0][1].iteration_time <= start_result.iteration_time
    # Here it is strictly better: ref and reward inference side by side on halves of the colocated cluster
    # (1.02 s together instead of 2 × 0.56 s), which no strategy's layout enumeration can express.
    assert found[0][1].iteration_time == pytest.approx(start_result.iteration_time - 0.1)
    assert found[0][0]["ref_inf"].mesh.isdisjoint(found[0][0]["reward_inf"].mesh)
    # From the (infeasible) pure-dp colocation, the search still reaches a feasible plan.
    from_colocate = search(
        PPO, CLUSTER, LayoutCost(), MEMORY, CONFIGS, seed=0, time_budget_s=300, chains=2, max_steps=100
    )
    assert from_colocate and from_colocate[0][1].feasible


def test_heuristic_layouts_beat_the_strategy_defaults():
    heuristics = best_heuristic_plans(PPO, CLUSTER, LayoutCost(), MEMORY, CONFIGS)
    plan, result = heuristics["colocate"]
    assert all(len(a.mesh) == 4 for name, a in plan.allocations.items() if name != "advantages")  # meshes kept
    assert any(a.layout.tp > 1 or a.layout.pp > 1 for a in plan.allocations.values())  # sharded to fit
    separate_plan = heuristics["separate"][0]
    assert separate_plan.shadow_roles(PPO) == ("actor",)


def test_search_respects_the_wall_clock_budget(monkeypatch):
    """The search reads its clock, not the machine's speed: on a clock that advances 10 ms at every reading it
    stops within a few readings of its budget however fast or loaded the machine is."""
    from loomrl.planner.search import search as search_module

    readings = []

    def monotonic() -> float:
        readings.append(0.01 * len(readings))
        return readings[-1]

    monkeypatch.setattr(search_module, "time", SimpleNamespace(monotonic=monotonic))
    found = search(PPO, CLUSTER, LayoutCost(), MEMORY, CONFIGS, seed=3, time_budget_s=0.5, chains=3)
    assert found and 0.5 <= readings[-1] <= 0.5 + 0.05


def test_search_argument_errors():
    with pytest.raises(ConfigError, match="chains"):
        search(PPO, CLUSTER, LayoutCost(), MEMORY, CONFIGS, seed=0, time_budget_s=1, chains=0)
    with pytest.raises(ConfigError, match="time_budget_s"):
        search(PPO, CLUSTER, LayoutCost(), MEMORY, CONFIGS, seed=0, time_budget_s=0)


def test_frozen_roles_stay_resident_where_memory_allows_and_reloading_costs_time():
    """On accelerators an offloaded role reloads before each call, so with room to spare the heuristics and the
    search keep ref and reward resident; where memory is short they offload them (the default rule)."""
    from loomrl.plan.cluster import profile_for
    from loomrl.plan.model_shape import ModelShape
    from loomrl.planner.cost.model import CostModel
    from loomrl.planner.cost.workload import Workload

    cluster = ClusterSpec.parse("h100:4")
    configs = {role: llama(heads=8, kv_heads=4, layers=4) for role in PPO.roles()}
    cost = CostModel(
        cluster,
        profile_for(cluster),
        {r: ModelShape.from_config(c) for r, c in configs.items()},
        Workload(batch=64, prompt_len=32, response_lengths=(32,)),
    )
    roomy = best_heuristic_plans(PPO, cluster, cost, 80 * GB, configs)
    plan, result = roomy["colocate"]
    assert plan.offloaded_roles(PPO) == () and result.feasible
    default = simulate(ExecutionPlan(cluster, plan.allocations), PPO, cost, 80 * GB)
    assert set(ExecutionPlan(cluster, plan.allocations).offloaded_roles(PPO)) == {"ref", "reward"}
    assert result.iteration_time < default.iteration_time  # the reloads it saves
    found = search(
        PPO,
        cluster,
        cost,
        80 * GB,
        configs,
        seed=0,
        time_budget_s=300,
        chains=2,
        max_steps=200,
        start=[p for p, _ in roomy.values()],
    )
    assert found[0][0].offloaded_roles(PPO) == ()
    # room for the trained roles and one frozen role's weights at a time, not both: offloading is what fits
    need = max(result.peak_memory.values())
    frozen = max(cost.static_memory(r, plan[m.name], False) for r in ("ref", "reward") for m in PPO.mfcs_of_role(r))
    tight = best_heuristic_plans(PPO, cluster, cost, need - frozen / 2, configs)
    assert tight["colocate"][1].feasible and set(tight["colocate"][0].offloaded_roles(PPO)) & {"ref", "reward"}


def test_crossovers_take_the_calls_of_one_kind_from_another_start_and_seed_the_extra_chains():
    heuristics = best_heuristic_plans(PPO, CLUSTER, LayoutCost(), MEMORY, CONFIGS)
    a, b = heuristics["colocate"][0], heuristics["interleave"][0]
    children = _crossovers([a, b], PPO)
    assert len(children) == 2 * 3  # each start with the generation, inference or training calls of the other
    train = {m.name for m in PPO if m.kind is MFCKind.TRAIN}
    assert {n: alloc.text for n, alloc in children[2].allocations.items()} == {
        n: (b[n] if n in train else a[n]).text for n in a.allocations
    }
    assert children[2].offload == a.offload
    # with more chains than starts, the best crossovers are walked too (and every one was simulated): the
    # result is never worse than the best of them, even without a single annealing step
    found = search(
        PPO, CLUSTER, LayoutCost(), MEMORY, CONFIGS, seed=0, time_budget_s=300, chains=4, max_steps=0, start=[a, b]
    )
    results = [simulate(c, PPO, LayoutCost(), MEMORY) for c in children]
    best_child = min(r.iteration_time for r in results if r.feasible)
    assert found[0][1].iteration_time <= best_child
