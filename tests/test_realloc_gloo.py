"""Reallocation on gloo (a world of 4 processes): every rank receives its direct slice of each parameter in every
scenario; schedules are reused, verified, and write into the tensors they are given."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from loomrl.parallel import realloc_exec, realloc_program
from loomrl.parallel.realloc_exec import (
    ReallocVerificationError,
    build_broadcast_groups,
    execute_reallocation,
)
from loomrl.parallel.spawn import run_world
from loomrl.plan import Allocation
from loomrl.plan.layout import Layout
from loomrl.plan.realloc_plan import ReallocPlan, plan_reallocation
from realloc_reference import place, reference_shard

WORLD = 4
TIMEOUT_S = 120
NUM_LAYERS = 2


def _gloo_node(device: int) -> int:
    return device // 2


def _llama_params() -> dict[str, tuple[int, ...]]:
    """A tiny Llama-shaped parameter dict (hidden 4, 2 kv heads of 1, MLP 8, vocab 12)."""
    params: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (12, 4)}
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        params[p + "self_attn.q_proj.weight"] = (4, 4)
        if i == 0:  # one bias only: routes then carry an odd number of 2-byte elements before wider ones
            params[p + "self_attn.q_proj.bias"] = (4,)
        params.update(
            {
                p + "self_attn.k_proj.weight": (2, 4),
                p + "self_attn.v_proj.weight": (2, 4),
                p + "self_attn.o_proj.weight": (4, 4),
                p + "mlp.gate_proj.weight": (8, 4),
                p + "mlp.up_proj.weight": (8, 4),
                p + "mlp.down_proj.weight": (4, 8),
                p + "input_layernorm.weight": (4,),
                p + "post_attention_layernorm.weight": (4,),
            }
        )
    params.update({"model.norm.weight": (4,), "lm_head.weight": (12, 4)})
    return params


def _dtypes() -> dict[str, torch.dtype]:
    # Mixed dtypes, with 2-byte biases of odd piece counts, exercise the byte layout of the route buffers.
    return {
        name: torch.float64 if "norm" in name else torch.bfloat16 if name.endswith("bias") else torch.float32
        for name in _llama_params()
    }


def _full_params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        name: torch.randn(shape, generator=gen, dtype=torch.float64).to(_dtypes()[name])
        for name, shape in _llama_params().items()
    }


SCENARIOS: dict[str, tuple[Allocation, Allocation]] = {
    "dp2tp2_to_tp4": (place((0, 1, 2, 3), Layout(dp=2, tp=2)), place((0, 1, 2, 3), Layout(tp=4))),
    "dp2tp2_to_dp4": (place((0, 1, 2, 3), Layout(dp=2, tp=2)), place((0, 1, 2, 3), Layout(dp=4))),
    "fsdp4_to_dp2tp2": (place((0, 1, 2, 3), Layout(dp=4), True), place((0, 1, 2, 3), Layout(dp=2, tp=2))),
    # A separate generation mesh (another node): broadcasts to (2, 3).
    "tp2_to_separate_dp2": (place((0, 1), Layout(tp=2)), place((2, 3), Layout(dp=2))),
    "pp2_to_tp2dp2": (place((0, 1, 2, 3), Layout(tp=2, pp=2)), place((0, 1, 2, 3), Layout(dp=2, tp=2))),
    "pp2tp2_to_dp4": (place((0, 1, 2, 3), Layout(tp=2, pp=2)), place((0, 1, 2, 3), Layout(dp=4))),
    "dp2tp2_to_fsdp4": (place((0, 1, 2, 3), Layout(dp=2, tp=2)), place((0, 1, 2, 3), Layout(dp=4), True)),
}


def _plan(scenario: str) -> ReallocPlan:
    src, dst = SCENARIOS[scenario]
    return plan_reallocation(_llama_params(), NUM_LAYERS, src, dst, _gloo_node)


def _my_source(placement: Allocation, device: int, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if device not in placement.mesh:
        return {}
    rank = placement.devices.index(device)
    parts = {name: reference_shard(t, name, placement, rank, NUM_LAYERS) for name, t in full.items()}
    return {name: part.clone() for name, part in parts.items() if part is not None}


DEFAULT_DIRECT_MIN_NUMEL = realloc_program.DIRECT_MIN_NUMEL
_PLANS: dict[str, ReallocPlan] = {}


def _plan_cached(scenario: str) -> ReallocPlan:
    """One plan object per scenario, so its compiled schedule can be inspected after the runs."""
    if scenario not in _PLANS:
        _PLANS[scenario] = _plan(scenario)
    return _PLANS[scenario]


def _run_scenario(scenario: str, device: int, full: dict[str, torch.Tensor], use_groups: bool) -> dict:
    plan = _plan(scenario)
    src, dst = SCENARIOS[scenario]
    groups = build_broadcast_groups(plan) if use_groups else None
    source = _my_source(src, device, full)
    out = execute_reallocation(plan, source, device, groups=groups, dtypes=_dtypes(), verify=True)
    expected = _my_source(dst, device, full)
    return {
        "keys_match": sorted(out) == sorted(expected),
        "mismatched": [n for n in expected if n in out and not torch.equal(out[n], expected[n])],
        "aliased_ok": all(
            _shares_storage(out[n], source[n]) == plan.aliased(device, n) for n in out if n in source and out[n].numel()
        ),
    }


def _corrupted_run(device: int, full: dict[str, torch.Tensor]) -> str | None:
    """Device 0 corrupts every buffer it sends after checksumming it; returns this rank's error, if any."""
    plan = _plan("dp2tp2_to_tp4")
    src, _ = SCENARIOS["dp2tp2_to_tp4"]
    original = realloc_exec._sum_sent

    def corrupting_sums(rb: Any, src_flat: Any) -> None:  # runs once a route is packed
        original(rb, src_flat)
        rb.buffer[16 * (len(rb.placed) + len(rb.direct)) :] += 1  # every packed data byte, not the checksums
        if rb.direct:  # direct entries travel from the parameters themselves: corrupt their sums instead
            rb.sums[len(rb.placed) :] += 1

    if device == 0:
        realloc_exec._sum_sent = corrupting_sums
    try:
        execute_reallocation(plan, _my_source(src, device, full), device, dtypes=_dtypes(), verify=True)
    except ReallocVerificationError as error:
        return str(error)
    finally:
        realloc_exec._sum_sent = original
    return None


def _repeated_runs(device: int, full: dict[str, torch.Tensor]) -> list[bool]:
    """Each scenario's plan object run three times (schedule and buffers reused), with new contents each time
    and verification switched on and off; whether every run gave this device its direct slices."""
    ok = []
    for scenario, (src, dst) in SCENARIOS.items():
        plan, groups = _plan(scenario), None
        for step in range(3):
            scaled = {name: (tensor.double() * (step + 2)).to(tensor.dtype) for name, tensor in full.items()}
            groups = groups or build_broadcast_groups(plan)
            out = execute_reallocation(
                plan, _my_source(src, device, scaled), device, groups=groups, dtypes=_dtypes(), verify=step == 1
            )
            expected = _my_source(dst, device, scaled)
            ok.append(sorted(out) == sorted(expected) and all(torch.equal(out[n], expected[n]) for n in expected))
    return ok


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _into_given_tensors(scenario: str, device: int, full: dict[str, torch.Tensor]) -> bool:
    """With ``out=``, the shards land in the caller's tensors (same storage) with the direct slices; aliased
    ones are views of the source shards, the caller's tensors for them untouched."""
    plan = _plan(scenario)
    src, dst = SCENARIOS[scenario]
    expected = _my_source(dst, device, full)
    source = _my_source(src, device, full)
    given = {name: torch.full_like(tensor, float("nan")) for name, tensor in expected.items()}
    got = execute_reallocation(plan, source, device, dtypes=_dtypes(), verify=True, out=given)
    return sorted(got) == sorted(expected) and all(
        torch.equal(got[n], expected[n])
        and (
            _shares_storage(got[n], source[n]) and bool(given[n].isnan().all())
            if plan.aliased(device, n)
            else got[n].data_ptr() == given[n].data_ptr()
        )
        for n in expected
    )


def _reused_bindings(device: int, full: dict[str, torch.Tensor]) -> list[str]:
    """With the same tensors passed again (as the runtime's workers do), a call reuses the schedule's bound
    views and copies: new values written in place into the source shards arrive, also after the given
    tensors' storage was freed and taken back; new source tensors are bound anew (on devices holding any).
    Returns what went wrong."""
    wrong = []
    for scenario, (src, dst) in SCENARIOS.items():
        plan, groups = _plan(scenario), None
        groups = build_broadcast_groups(plan)
        source = _my_source(src, device, full)
        given = {
            name: torch.zeros_like(tensor)
            for name, tensor in _my_source(dst, device, full).items()
            if not plan.aliased(device, name)
        }
        schedule, bound = realloc_exec.compile_program(plan, device), None
        for step in range(4):
            scaled = {name: (tensor.double() * (step + 2)).to(tensor.dtype) for name, tensor in full.items()}
            if step == 3:  # new source tensors (new storage): bound anew
                source = {name: tensor.clone() for name, tensor in source.items()}
            for name, tensor in _my_source(src, device, scaled).items():
                source[name].copy_(tensor)
            if step == 2:  # the copy freed and taken back, as the runtime does on CPU devices
                for tensor in given.values():
                    tensor.untyped_storage().resize_(0)
                    tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
            out = execute_reallocation(plan, source, device, groups=groups, dtypes=_dtypes(), out=given)
            expected = _my_source(dst, device, scaled)
            if sorted(out) != sorted(expected) or not all(torch.equal(out[n], expected[n]) for n in expected):
                wrong.append(f"{scenario} step {step}: values")
            reused = schedule.binding is bound
            rebinds = step == 0 or step == 3 and bool(schedule.src_numel)  # a device without source shards keeps it
            if reused == rebinds:
                wrong.append(f"{scenario} step {step}: reused={reused}")
            bound = schedule.binding
    return wrong


def _body(rank: int) -> dict:
    full = _full_params()
    results = {name: _run_scenario(name, rank, full, use_groups=i % 2 == 0) for i, name in enumerate(SCENARIOS)}
    results["into_out"] = {name: _into_given_tensors(name, rank, full) for name in SCENARIOS}
    realloc_program.DIRECT_MIN_NUMEL = 1  # again with every contiguous entry sent unpacked, in its own message
    results["direct"] = {
        name: _run_scenario(name, rank, full, use_groups=i % 2 == 1) for i, name in enumerate(SCENARIOS)
    }
    results["direct_entries"] = sum(
        len(e) for name in SCENARIOS for e in realloc_exec.compile_program(_plan_cached(name), rank).direct.values()
    )
    realloc_program.DIRECT_MIN_NUMEL = DEFAULT_DIRECT_MIN_NUMEL
    results["corrupted"] = _corrupted_run(rank, full)
    results["repeated"] = _repeated_runs(rank, full)
    results["reused"] = _reused_bindings(rank, full)
    dist.barrier()
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_world(_body, WORLD, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_gloo_reallocation_gives_every_rank_its_direct_slice(ranks: list[dict], scenario: str):
    for rank, result in enumerate(ranks):
        assert result[scenario] == {"keys_match": True, "mismatched": [], "aliased_ok": True}, (rank, scenario)
        assert result["direct"][scenario] == {"keys_match": True, "mismatched": [], "aliased_ok": True}, (
            rank,
            scenario,
            "direct",
        )
    assert sum(result["direct_entries"] for result in ranks) > 0  # the unpacked path was taken
    assert all(result["into_out"][scenario] for result in ranks), scenario


def test_gloo_scenarios_cover_broadcasts_and_point_to_point():
    plans = {name: _plan(name) for name in SCENARIOS}
    broadcast_only = ("tp2_to_separate_dp2", "pp2tp2_to_dp4")  # every piece goes to a node's two devices
    for name in broadcast_only:
        assert any(len(t.receivers) > 1 for t in plans[name].transfers), name
    assert all(
        any(len(t.receivers) == 1 and not t.local for t in plan.transfers)
        for name, plan in plans.items()
        if name not in broadcast_only
    )


def test_gloo_verification_names_the_corrupted_parameter(ranks: list[dict]):
    plan = _plan("dp2tp2_to_tp4")
    corrupted = [t for t in plan.transfers if t.sender == 0 and not t.local]
    victims = {r for t in corrupted for r in t.receivers}
    assert victims == {1}  # same-node preference: device 0 only serves device 1
    for rank, result in enumerate(ranks):
        message = result["corrupted"]
        if rank in victims:
            assert message is not None and "from device 0 fail verification" in message
            assert message.split(":")[0] in {t.param for t in corrupted}
        else:
            assert message is None, (rank, message)


def test_gloo_reallocation_reuses_its_schedule_across_calls(ranks: list[dict]):
    for rank, result in enumerate(ranks):
        assert result["repeated"] == [True] * 3 * len(SCENARIOS), rank


def test_gloo_reallocation_reuses_bound_tensors_while_the_same_ones_return(ranks: list[dict]):
    for rank, result in enumerate(ranks):
        assert result["reused"] == [], rank
