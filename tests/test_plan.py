"""Execution plans and placement strategies on the real PPO and GRPO workflows.

Checks each strategy's plan on 2, 4 and 8 devices, the derived facts (reallocations, shadows, offloading,
concurrent groups, memory) against hand-computed values, placement-string and JSON/YAML round trips, and that
every invalid plan fails with one line naming the MFC or field and the values.
"""

import ast
import json
import pickle
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from loomrl.algorithms.workflows import build_workflow
from loomrl.config.schema import AlgoConfig, RolloutConfig
from loomrl.errors import ConfigError
from loomrl.plan import (
    GB,
    PROFILES,
    Allocation,
    ClusterSpec,
    DeviceSet,
    ExecutionPlan,
    colocate,
    format_plan_string,
    interleave,
    make_plan,
    param_count,
    parse_plan_string,
    separate,
    shard_bytes,
    split_devices,
    split_devices_pow2,
)
from loomrl.plan.layout import Coords, Layout
from loomrl.plan.schedule import StepKind, build_schedule
from oracles import concurrent_groups

PPO = build_workflow(AlgoConfig(name="ppo"), RolloutConfig())
GRPO = build_workflow(AlgoConfig(name="grpo"), RolloutConfig())
EXAMPLE = (
    "actor_gen=0-3:dp4; ref_inf=4-5:dp2; reward_inf=6-7:dp2; critic_inf=4-7:dp4; "
    "actor_train=0-7:dp4tp2; critic_train=0-7:dp8"
)


def llama(hidden=128, layers=4, heads=4, kv_heads=2, inter=512, vocab=48) -> SimpleNamespace:
    return SimpleNamespace(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=inter,
        vocab_size=vocab,
    )


TINY = {role: llama() for role in ("actor", "critic", "ref", "reward")}
LLAMA_7B = llama(hidden=4096, layers=32, heads=32, kv_heads=32, inter=11008, vocab=32000)


def cluster(n: int) -> ClusterSpec:
    return ClusterSpec.parse(f"cpu:{n}")


def placement_steps(plan: ExecutionPlan, workflow=PPO) -> list[tuple[str, str]]:
    """(kind, id) of every step of the plan's schedule that is not a call."""
    return [(s.kind.value, s.id) for s in build_schedule(workflow, plan) if s.kind is not StepKind.CALL]


def one_line_error(fn: Callable[[], object], *fragments: str) -> str:
    with pytest.raises(ConfigError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# --- cluster, mesh, allocation ---------------------------------------------------------------------------


def test_cluster_parse_and_nodes():
    c = ClusterSpec.parse("h100:8x8")
    assert (c.nodes, c.devices_per_node, c.n_devices, c.profile, c.memory_gb) == (8, 8, 64, "h100-80g", 80.0)
    assert (c.node_of(0), c.node_of(7), c.node_of(8), c.node_of(63)) == (0, 0, 1, 7)
    assert ClusterSpec.parse("cpu:2") == ClusterSpec(1, 2)
    assert ClusterSpec.parse("cpu:1x4").n_devices == 4 and str(ClusterSpec.parse("cpu:1x4")) == "cpu:1x4"
    assert ClusterSpec.parse("h200:2").memory_gb == PROFILES["h200"].memory_bytes / GB == 141.0
    # the A800 and H800 (NVLink cut to 400 GB/s) and the GB200 joined the datasheet profiles for published runs
    assert set(PROFILES) == {"a100-80g", "a800", "h100-80g", "h800", "h200", "h20", "gb200", "local"}
    assert ClusterSpec.parse("gb200:1x72").memory_gb == PROFILES["gb200"].memory_bytes / GB == 186.0
    one_line_error(lambda: ClusterSpec.parse("tpu:8"), "unknown device kind 'tpu'", "h100")
    one_line_error(lambda: ClusterSpec.parse("cpu-8"), "cpu-8", "KIND:NODESxDEVICES")
    one_line_error(lambda: ClusterSpec.parse("cpu:0"), "at least one")
    one_line_error(lambda: c.node_of(64), "device 64", "0-63")
    one_line_error(lambda: ClusterSpec(1, 2, profile="v100"), "profile", "'v100'", "h100-80g")


def test_mesh_is_sorted_and_compact():
    mesh = DeviceSet.parse("6, 0-3")
    assert mesh.devices == (0, 1, 2, 3, 6) and mesh.text == "0-3,6" and len(mesh) == 5
    assert DeviceSet((5, 2, 0)).devices == (0, 2, 5) and DeviceSet.parse("0,2,5").text == "0,2,5"
    assert mesh.isdisjoint(DeviceSet((4, 5))) and not mesh.isdisjoint(DeviceSet((3,)))
    one_line_error(lambda: DeviceSet(()), "devices", "empty")
    one_line_error(lambda: DeviceSet((1, 2, 1)), "devices", "device 1 twice")
    one_line_error(lambda: DeviceSet.parse("3-1"), "'3-1'", "ends before it starts")
    one_line_error(lambda: DeviceSet.parse("0-x"), "'0-x'", "0-3")


def test_rank_to_device_mapping():
    # rank = pp_rank·(dp·tp) + dp_rank·tp + tp_rank, device = mesh[rank]; coordinates are (pp, dp, tp)
    alloc = Allocation((2, 3, 5, 7, 8, 9, 10, 11), Layout(dp=2, tp=2, pp=2))
    assert alloc.device(Coords(pp=0, dp=0, tp=1)) == 3  # rank 1
    assert alloc.device(Coords(pp=0, dp=1, tp=0)) == 5  # rank 2
    assert alloc.device(Coords(pp=1, dp=1, tp=0)) == 10  # rank 4 + 2
    assert alloc.coords(10) == Coords(pp=1, dp=1, tp=0) and alloc.coords(11) == (1, 1, 1)
    assert [alloc.device(alloc.coords(d)) for d in alloc.mesh] == list(alloc.mesh)
    assert [alloc.layout.coords(r) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert Allocation.parse("0-7:tp2") == Allocation(tuple(range(8)), Layout(dp=4, tp=2))
    assert Allocation.parse("0,2:dp2mb4").micro_batches == 4 and Allocation.parse("0-3").layout == Layout(dp=4)
    one_line_error(lambda: alloc.device(Coords(0, 2, 0)), "dp_rank: 2", "0..1")


# --- strategies -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("workflow", [PPO, GRPO], ids=["ppo", "grpo"])
@pytest.mark.parametrize("strategy", ["colocate", "interleave", "separate"])
def test_every_strategy_validates(strategy, workflow, n):
    plan = make_plan(strategy, workflow, cluster(n), model_configs=TINY)
    plan.validate(workflow, TINY)
    assert set(plan.allocations) == {m.name for m in workflow}
    assert all(d < n for a in plan.allocations.values() for d in a.mesh)


def test_colocate_reallocates_only_when_generation_layout_differs():
    c = cluster(8)
    same = colocate(PPO, c)
    assert all(a.mesh.devices == tuple(range(8)) for n, a in same.allocations.items() if n != "advantages")
    assert placement_steps(same) == []
    assert same.canonical_layout(PPO, "actor") == same["actor_train"] and same.canonical_layout(PPO, "ref") is None
    plan = colocate(
        PPO,
        c,
        {"actor": Layout(dp=4, tp=2), "actor_gen": Layout(dp=8)},
    )
    plan.validate(PPO, TINY)
    steps = build_schedule(PPO, plan)
    assert placement_steps(plan) == [("copy", "copy actor→0-7:dp8"), ("free", "free actor@0-7:dp8")]
    copy, free = steps["copy actor→0-7:dp8"], steps["free actor@0-7:dp8"]
    assert copy.src == plan["actor_train"].shards and copy.alloc == plan["actor_gen"] and copy.moves_bytes
    assert steps["actor_gen"].deps == ("copy actor→0-7:dp8",) and copy.deps == ()
    assert free.deps == ("actor_gen",) and not free.moves_bytes  # returning is a free, not a copy
    assert plan["actor_train"].layout == Layout(dp=4, tp=2) and plan.shadow_roles(PPO) == ()
    assert plan.offloaded_roles(PPO) == ("ref", "reward")  # frozen and time-shared
    one_line_error(lambda: colocate(PPO, c, {"actor": Layout(dp=2)}), "layouts.actor", "dp=2", "has 8")
    one_line_error(lambda: colocate(PPO, c, {"judge": Layout(dp=8)}), "layouts.judge", "actor_gen")


@pytest.mark.parametrize("n", [4, 8])
def test_interleave_runs_independent_calls_side_by_side(n):
    plan = interleave(PPO, cluster(n))
    inference = ["ref_inf", "reward_inf", "critic_inf"]
    meshes = [set(plan[name].mesh) for name in inference]
    assert all(a.isdisjoint(b) for i, a in enumerate(meshes) for b in meshes[i + 1 :])
    assert set().union(*meshes) == set(range(n))
    assert plan["actor_gen"].mesh.devices == tuple(range(n))
    assert set(plan["actor_train"].mesh).isdisjoint(plan["critic_train"].mesh)
    groups = concurrent_groups(plan, PPO)
    assert frozenset(inference) in groups and frozenset({"actor_train", "critic_train"}) in groups
    assert all(len(g) > 1 for g in groups) and not any({"actor_gen", "ref_inf"} <= g for g in groups)


def test_interleave_splits_devices_by_model_size():
    assert split_devices(8, [1, 1, 1]) == [3, 3, 2]
    assert split_devices(8, [1, 3]) == [2, 6]
    assert split_devices(4, [100, 1, 1]) == [2, 1, 1]  # at least one device each
    assert split_devices(3, [1, 1, 1]) == [1, 1, 1]
    one_line_error(lambda: split_devices(2, [1, 1, 1]), "3 calls", "2 devices")
    configs = {**TINY, "critic": llama(hidden=256), "reward": llama(hidden=256)}
    weights = [param_count(configs[r]) for r in ("ref", "reward", "critic")]
    # a power-of-two cluster splits into power-of-two ranges (shardable, aligned); others proportionally
    plan = interleave(PPO, cluster(8), configs)
    assert [len(plan[n].mesh) for n in ("ref_inf", "reward_inf", "critic_inf")] == split_devices_pow2(8, weights)
    assert split_devices_pow2(8, weights) == [2, 4, 2] and split_devices(8, weights) == [2, 3, 3]
    assert [
        len(interleave(PPO, cluster(6), configs)[n].mesh) for n in ("ref_inf", "reward_inf", "critic_inf")
    ] == split_devices(6, weights)
    assert split_devices_pow2(64, [1, 1, 1]) == [32, 16, 16] and split_devices_pow2(8, [1, 1, 1]) == [4, 2, 2]
    assert split_devices_pow2(4, [1, 1, 1, 100]) == [1, 1, 1, 1]  # at least one each: the large one gives way
    assert split_devices_pow2(8, [1, 3]) == [4, 4]  # 2 + 4 fall short; only the 2 fits the remainder
    one_line_error(lambda: split_devices_pow2(6, [1, 1]), "not a power of two")
    balanced = interleave(PPO, cluster(8), configs, split="proportional")
    assert [len(balanced[n].mesh) for n in ("ref_inf", "reward_inf", "critic_inf")] == [2, 3, 3]
    one_line_error(lambda: interleave(PPO, cluster(6), split="pow2"), "split='pow2'", "6 devices")
    one_line_error(lambda: interleave(PPO, cluster(8), split="even"), "split='even'", "pow2, proportional")
    small = interleave(PPO, cluster(2))  # three inference calls, two devices: that depth is colocated
    assert all(len(small[n].mesh) == 2 for n in ("ref_inf", "reward_inf", "critic_inf"))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_separate_gives_generation_its_own_devices_and_a_shadow(n):
    plan = separate(PPO, cluster(n), gen_devices=n // 2)
    gen, train = plan["actor_gen"].mesh, plan["actor_train"].mesh
    assert gen.devices == tuple(range(n // 2)) and gen.isdisjoint(train)
    assert set(gen) | set(train) == set(range(n))
    assert plan.shadow_roles(PPO) == ("actor",) and plan.shadow_calls(PPO, "actor") == ["actor_gen"]
    schedule = build_schedule(PPO, plan)
    sync = f"sync actor→{plan['actor_gen'].text}"
    assert placement_steps(plan) == [("sync", sync)]
    assert schedule[sync].src == plan["actor_train"].shards and schedule[sync].alloc == plan["actor_gen"]
    assert schedule[sync].deps == ("actor_train",) and [s.id for s in schedule.prologue] == [sync]
    assert make_plan("separate:1", GRPO, cluster(n))["actor_gen"].mesh.devices == (0,)
    one_line_error(lambda: separate(PPO, cluster(n), gen_devices=n), f"gen_devices={n}", f"1-{n - 1}")


def test_offload_rule_and_explicit_choices():
    c = cluster(4)
    text = "actor_gen=0-1; ref_inf=2; reward_inf=3; critic_inf=0-1; actor_train=0-1; critic_train=0-1"
    plan = parse_plan_string(text, PPO, c)
    assert plan.offloaded_roles(PPO) == ()  # ref and reward each own a device nobody else uses
    assert placement_steps(plan) == []
    explicit = parse_plan_string(text + "; offload=ref; shadow=", PPO, c)
    assert explicit.offloaded_roles(PPO) == ("ref",) and explicit.shadow_roles(PPO) == ()
    no_shadow = parse_plan_string(
        "actor_gen=0-1; ref_inf=2-3; reward_inf=2-3; critic_inf=2-3; actor_train=2-3; critic_train=2-3; shadow=", PPO, c
    )
    assert placement_steps(no_shadow) == [("copy", "copy actor→0-1:dp2"), ("free", "free actor@0-1:dp2")]


# --- plan strings and files -------------------------------------------------------------------------


def test_placement_string_round_trip():
    c = cluster(8)
    plan = parse_plan_string(EXAMPLE, PPO, c)
    assert plan["actor_train"] == Allocation(tuple(range(8)), Layout(dp=4, tp=2))
    assert plan["advantages"] == Allocation((0,), Layout())  # compute steps default to device 0
    text = format_plan_string(plan, PPO)
    assert text == EXAMPLE
    assert parse_plan_string(text, PPO, c) == plan
    assert parse_plan_string(format_plan_string(plan), PPO, c) == plan  # with the compute step spelled out
    assert concurrent_groups(plan, PPO) == [frozenset({"ref_inf", "reward_inf"})]  # critic_inf overlaps both
    assert pickle.loads(pickle.dumps(plan)) == plan  # plans travel to workers
    odd = parse_plan_string(
        "actor_gen=0,2,4,6:dp2tp2mb3; ref_inf=1,3; reward_inf=5,7; critic_inf=0-7:pp2; "
        "advantages=7; actor_train=0-7:tp2pp2; critic_train=0-7; offload=reward,ref",
        PPO,
        c,
    )
    assert odd["critic_inf"].layout == Layout(dp=4, pp=2) and odd.offload == ("ref", "reward")
    assert parse_plan_string(format_plan_string(odd, PPO), PPO, c) == odd
    for strategy in ("colocate", "interleave", "separate"):
        made = make_plan(strategy, GRPO, c)
        assert parse_plan_string(format_plan_string(made, GRPO), GRPO, c) == made


def test_activation_recompute_is_a_train_call_choice_that_round_trips(tmp_path: Path):
    c = cluster(8)
    text = EXAMPLE.replace("actor_train=0-7:dp4tp2", "actor_train=0-7:dp4tp2mb2rc")
    plan = parse_plan_string(text, PPO, c)
    assert plan["actor_train"] == Allocation(tuple(range(8)), Layout(dp=4, tp=2), 2, recompute=True)
    assert plan["actor_train"].text == "0-7:dp4tp2mb2rc" and not plan["critic_train"].recompute
    assert parse_plan_string(format_plan_string(plan, PPO), PPO, c) == plan
    assert ExecutionPlan.from_dict(plan.to_dict()) == plan
    assert plan["actor_train"].shards == Allocation(tuple(range(8)), Layout(dp=4, tp=2))  # no transfer
    one_line_error(
        lambda: parse_plan_string(text.replace("ref_inf=4-5:dp2", "ref_inf=4-5:dp2rc"), PPO, c),
        "plan.allocations.ref_inf",
        "rc is for train calls only",
    )
    one_line_error(lambda: Allocation.parse("0-1:dp2rcrc"), "rc twice")


def test_zero_is_a_train_call_choice_that_round_trips_and_shrinks_the_optimizer_state():
    c = cluster(8)
    text = EXAMPLE.replace("actor_train=0-7:dp4tp2", "actor_train=0-7:dp4tp2mb2rczero")
    plan = parse_plan_string(text, PPO, c)
    assert plan["actor_train"] == Allocation(tuple(range(8)), Layout(dp=4, tp=2), 2, recompute=True, zero=True)
    assert plan["actor_train"].text == "0-7:dp4tp2mb2rczero" and not plan["critic_train"].zero
    assert parse_plan_string(format_plan_string(plan, PPO), PPO, c) == plan
    assert ExecutionPlan.from_dict(plan.to_dict()) == plan
    assert plan["actor_train"].shards == Allocation(tuple(range(8)), Layout(dp=4, tp=2))  # no transfer
    one_line_error(
        lambda: parse_plan_string(text.replace("ref_inf=4-5:dp2", "ref_inf=4-5:dp2zero"), PPO, c),
        "plan.allocations.ref_inf",
        "zero is for train calls only",
    )
    one_line_error(lambda: Allocation.parse("0-1:dp2zerozero"), "zero twice")
    # the Adam moments (8 of the 16 bytes per fp32 parameter here) are divided over dp=4
    assert shard_bytes(1000, 2, 1, 4, trained=True, optimizer_shards=4) == 4000 + 1000
    assert shard_bytes(1000, 2, 1, 4, trained=True) == 4000 + 4000
    # bf16 mixed precision: fp32 gradients and an fp32 master copy, 2 + 4 + 12 bytes per parameter (Megatron's
    # 18 with fp32 gradient accumulation), the 12 of the optimizer sharded
    assert shard_bytes(1000, 1, 1, 2, trained=True) == 18 * 1000
    assert shard_bytes(1000, 1, 1, 2, trained=True, optimizer_shards=4) == 6 * 1000 + 12 * 1000 // 4
    assert shard_bytes(1000, 1, 1, 2, trained=False) == 2000
    configs = {role: llama() for role in PPO.roles()}
    plain = parse_plan_string(EXAMPLE, PPO, c).role_memory(PPO, configs)
    assert plan.role_memory(PPO, configs)[0]["actor"] < plain[0]["actor"]
    assert plan.role_memory(PPO, configs)[0]["critic"] == plain[0]["critic"]


def test_fsdp_is_a_train_call_choice_that_shards_everything_and_needs_a_copy_for_other_calls():
    c = cluster(8)
    text = EXAMPLE.replace("critic_train=0-7:dp8", "critic_train=0-7:dp8mb2fsdp").replace(
        "critic_inf=4-7:dp4", "critic_inf=0-7:dp8"
    )
    plan = parse_plan_string(text, PPO, c)
    assert plan["critic_train"] == Allocation(tuple(range(8)), Layout(dp=8), 2, fsdp=True)
    assert plan["critic_train"].text == "0-7:dp8mb2fsdp" and plan["critic_train"].param_shards == 8
    assert plan["critic_train"].optimizer_shards == 8 and plan["actor_train"].param_shards == 1
    assert parse_plan_string(format_plan_string(plan, PPO), PPO, c) == plan
    assert ExecutionPlan.from_dict(plan.to_dict()) == plan
    # the critic's inference on the same devices and layout runs on a whole copy: a reallocation from the shards
    assert plan["critic_inf"].shards != plan["critic_train"].shards
    assert build_schedule(PPO, plan)["critic_inf"].deps == ("actor_gen", "copy critic→0-7:dp8")
    one_line_error(
        lambda: parse_plan_string(text.replace("critic_inf=0-7:dp8", "critic_inf=0-7:dp8fsdp"), PPO, c),
        "plan.allocations.critic_inf",
        "fsdp is for train calls only",
    )
    one_line_error(lambda: Allocation.parse("0-7:dp4pp2fsdp"), "fsdp", "valid with fsdp: pp=1, any dp and tp")
    assert Allocation.parse("0-7:dp4tp2fsdp").param_shards == 4  # FSDP over dp of each tp shard
    one_line_error(lambda: Allocation.parse("0-7:dp8zerofsdp"), "zero", "give one of zero and fsdp")
    # fp32 shards (their own master copy), fp32 gradients and Adam's moments: 16 bytes per parameter over dp,
    # in either precision
    assert shard_bytes(1000, 1, 1, 2, trained=True, optimizer_shards=4, param_shards=4) == 16 * 1000 // 4
    assert shard_bytes(1000, 1, 1, 4, trained=True, optimizer_shards=4, param_shards=4) == 16 * 1000 // 4
    configs = {role: llama() for role in PPO.roles()}
    params = param_count(configs["critic"])  # device 0: 1/8 of the trained state, and the inference copy whole
    want = shard_bytes(params, 1, 1, 4, trained=True, optimizer_shards=8, param_shards=8) + params * 4
    assert plan.role_memory(PPO, configs)[0]["critic"] == want


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
def test_file_round_trip(tmp_path: Path, suffix):
    plan = parse_plan_string(EXAMPLE + "; shadow=; offload=ref", PPO, cluster(8))
    assert ExecutionPlan.from_dict(plan.to_dict()) == plan
    path = tmp_path / f"plan{suffix}"
    plan.save(path)
    assert ExecutionPlan.load(path) == plan
    assert make_plan(str(path), PPO, cluster(8)) == plan
    one_line_error(lambda: make_plan(str(path), PPO, cluster(4)), str(path), "cpu:1x8", "cpu:1x4")


def test_from_dict_is_strict_and_accepts_device_lists(tmp_path: Path):
    data = colocate(GRPO, cluster(2)).to_dict()
    data["allocations"]["actor_gen"]["devices"] = [1, 0]
    assert ExecutionPlan.from_dict(data)["actor_gen"].mesh.devices == (0, 1)
    data["allocations"]["actor_gen"]["micro_batch"] = 2
    one_line_error(
        lambda: ExecutionPlan.from_dict(data),
        "plan.allocations.actor_gen.micro_batch",
        "unknown key",
        "devices, dp, tp, pp, micro_batches",
        "did you mean 'micro_batches'",
    )
    del data["allocations"]["actor_gen"]["micro_batch"]
    data["allocations"]["ref_inf"]["devices"] = "0-x"
    one_line_error(lambda: ExecutionPlan.from_dict(data), "plan.allocations.ref_inf.devices", "'0-x'")
    data["allocations"]["ref_inf"]["devices"] = "0-1"
    data["cluster"]["memory"] = 4
    one_line_error(lambda: ExecutionPlan.from_dict(data), "plan.cluster.memory", "memory_gb")
    path = tmp_path / "dup.json"
    path.write_text('{"cluster": {}, "cluster": {}}')
    one_line_error(lambda: ExecutionPlan.load(path), "dup.json", "duplicate key 'cluster'")
    one_line_error(lambda: ExecutionPlan.load(tmp_path / "plan.txt"), "plan.txt", ".json, .yaml")
    one_line_error(lambda: ExecutionPlan.load(tmp_path / "missing.yaml"), "missing.yaml", "not found")


# --- validation errors: one line naming the MFC or field and the values ---------------------------------


def _with(plan: ExecutionPlan, name: str, text: str) -> ExecutionPlan:
    return plan.with_allocation(name, Allocation.parse(text))


def test_allocation_coverage_errors():
    plan = colocate(PPO, cluster(8))
    missing = ExecutionPlan(plan.cluster, {k: v for k, v in plan.allocations.items() if k != "critic_train"})
    one_line_error(lambda: missing.validate(PPO), "MFC 'critic_train' has no allocation")
    one_line_error(
        lambda: _with(plan, "critic_trian", "0-7").validate(PPO),
        "plan.allocations.critic_trian",
        "unknown MFC",
        "did you mean 'critic_train'",
    )
    one_line_error(lambda: plan.validate(GRPO), "plan.allocations.critic_inf", "unknown MFC")


def test_structural_errors():
    plan = colocate(PPO, cluster(8))
    one_line_error(
        lambda: _with(plan, "ref_inf", "4-9"), "plan.allocations.ref_inf.devices", "device 8", "cpu:1x8", "0-7"
    )
    one_line_error(lambda: Allocation.parse("0-3:dp2tp4"), "dp=2 × tp=4 × pp=1 = 8 devices", "mesh 0-3 has 4")
    one_line_error(lambda: Allocation.parse("0-3:dp4mb0"), "layout", "mb0", "positive")
    one_line_error(lambda: Allocation(DeviceSet((0,)), Layout(), micro_batches=0), "micro_batches", "0", ">= 1")
    one_line_error(
        lambda: _with(plan, "advantages", "0-1:tp2").validate(PPO),
        "plan.allocations.advantages.tp",
        "2",
        "compute step",
        "valid: 1",
    )
    one_line_error(
        lambda: parse_plan_string(EXAMPLE.replace("dp4tp2", "dp4tp3"), PPO, cluster(8)),
        "actor_train=0-7:dp4tp3",
        "actor_train.layout",
        "dp=4 × tp=3 × pp=1 = 12 devices",
        "has 8",
    )
    one_line_error(
        lambda: parse_plan_string(EXAMPLE.replace("critic_train=0-7:dp8", ""), PPO, cluster(8)),
        "MFC 'critic_train' is not placed",
    )
    one_line_error(
        lambda: parse_plan_string(EXAMPLE.replace("dp4tp2", "dp4tq2"), PPO, cluster(8)),
        "actor_train.layout",
        "'dp4tq2'",
        "dp<N>",
    )
    one_line_error(lambda: parse_plan_string("actr_gen=0-7", PPO, cluster(8)), "unknown MFC 'actr_gen'", "'actor_gen'")
    one_line_error(lambda: parse_plan_string("actor_gen 0-7", PPO, cluster(8)), "'actor_gen 0-7'", "NAME=DEVICES")
    one_line_error(lambda: parse_plan_string(EXAMPLE + "; ref_inf=0-7", PPO, cluster(8)), "'ref_inf' is placed twice")


def test_choice_errors():
    plan = separate(PPO, cluster(4))
    one_line_error(
        lambda: ExecutionPlan(plan.cluster, plan.allocations, shadow=("ref",)).validate(PPO),
        "plan.shadow",
        "role 'ref' never trains",
        "trained roles: actor, critic",
    )
    one_line_error(
        lambda: ExecutionPlan(plan.cluster, plan.allocations, shadow=("critic",)).validate(PPO),
        "plan.shadow",
        "role 'critic' has no call off its training devices 2-3",
    )
    one_line_error(
        lambda: ExecutionPlan(plan.cluster, plan.allocations, offload=("judge",)).validate(PPO),
        "plan.offload",
        "unknown role 'judge'",
        "actor, ref, reward, critic",
    )
    one_line_error(lambda: make_plan("coloc", PPO, cluster(4)), "'coloc'", "unknown strategy", "colocate, interleave")
    one_line_error(lambda: make_plan("separate:x", PPO, cluster(4)), "'x'", "separate:2")
    one_line_error(lambda: make_plan("interleave", PPO, cluster(4), gen_devices=1), "gen_devices", "separate")


@pytest.mark.parametrize(
    ("field", "config", "tp", "pp"),
    [
        ("num_attention_heads=4", llama(heads=4, kv_heads=4), 3, 1),
        ("num_key_value_heads=2", llama(heads=8, kv_heads=2, inter=512), 4, 1),
        ("intermediate_size=1002", llama(heads=8, kv_heads=8, inter=1002), 4, 1),
        ("num_hidden_layers=4", llama(layers=4), 1, 3),
    ],
)
def test_divisibility_errors(field, config, tp, pp):
    c = cluster(tp * pp)
    plan = colocate(GRPO, c, {"actor_train": Layout(tp=tp, pp=pp)})
    configs = {**TINY, "actor": config}
    which = "tp" if tp > 1 else "pp"
    one_line_error(
        lambda: plan.validate(GRPO, configs),
        f"plan.allocations.actor_train.{which}",
        f"{tp if tp > 1 else pp} does not divide {field}",
        "role 'actor'",
        f"valid {which}: 1",
    )
    one_line_error(lambda: plan.validate(GRPO, {"actor": config}), "model_configs", "no config for role 'ref'")


def test_memory_estimate_and_error():
    p = param_count(LLAMA_7B)
    assert p == 6_738_415_616  # LLaMA-7B's published count with untied embeddings
    configs = {role: LLAMA_7B for role in ("actor", "critic", "ref", "reward")}
    c = ClusterSpec.parse("h100:1x8")
    plan = colocate(PPO, c)
    # per device: actor and critic trained (4 + 4 + 8 bytes per parameter each), ref and reward offloaded
    # (only one of them, 4 bytes per parameter, resident at a time)
    assert plan.peak_memory(PPO, configs)[3] == 16 * p + 16 * p + 4 * p
    assert plan.role_memory(PPO, configs)[3] == {"actor": 16 * p, "ref": 4 * p, "reward": 4 * p, "critic": 16 * p}
    need = 36 * p / GB
    message = one_line_error(
        lambda: plan.validate(PPO, configs),
        "device 0",
        f"{need:.1f} GB",
        "has 80.0 GB",
        "h100-80g",
        "actor 100.4",
        "ref 25.1 offloaded",
    )
    assert message.startswith("plan: device 0 needs an estimated")
    # tp=8 on every call shards every model eight ways: 36·P/8 bytes ≈ 28 GB fits
    sharded = colocate(PPO, c, {r: Layout(tp=8) for r in ("actor", "critic", "ref", "reward")})
    sharded.validate(PPO, configs)
    assert sharded.peak_memory(PPO, configs)[0] == 2 * (-(-16 * p // 8)) + -(-4 * p // 8)
    gen_copy = colocate(PPO, c, {"actor": Layout(tp=8), "actor_gen": Layout(dp=2, tp=4)})
    assert gen_copy.role_memory(PPO, configs)[0]["actor"] == -(-16 * p // 8) + -(-4 * p // 4)  # + resharded copy
    one_line_error(lambda: sharded.validate(PPO, configs, bytes_per_param=0), "bytes_per_param", "0")


def test_plan_package_imports_neither_ray_nor_torch():
    for path in Path("loomrl/plan").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n.split(".")[0] in ("ray", "torch") for n in names), (path, names)


def test_to_dict_is_plain_json():
    plan = interleave(PPO, cluster(4))
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["allocations"]["ref_inf"] == {"devices": "0-1", "dp": 2, "tp": 1, "pp": 1, "micro_batches": 1}
    assert data["cluster"] == {
        "nodes": 1,
        "devices_per_node": 4,
        "device_kind": "cpu",
        "profile": "local",
        "memory_gb": 24.0,
    }


def test_plans_are_data_importing_them_loads_neither_ray_nor_torch_distributed():
    import subprocess
    import sys

    code = (
        "import sys, loomrl.plan; bad = [m for m in ('ray', 'torch.distributed') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
