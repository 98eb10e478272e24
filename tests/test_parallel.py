"""loomrl.parallel against the single-process reference: tensor parallel (TP=2) and data parallel (DP=2) on gloo.

One spawn of two processes runs every multi-process check (importing transformers dominates a spawn's cost):
the world holds an actor laid out tp=2 and a critic laid out dp=2, and each rank compares its sharded or
data-parallel model with an unsharded copy built from the same seed in the same process. Ranks send plain
numbers back; the tests below assert on them in the parent. Layout validation is checked without any spawn.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, distribute_tensor

from loomrl.errors import ConfigError
from loomrl.models.heads import score_head, token_logprobs, token_values
from loomrl.models.tokenizer import build_char_tokenizer
from loomrl.models.zoo import build_causal_lm, build_value_model, zoo_config
from loomrl.parallel import (
    Layout,
    apply_tensor_parallel,
    check_layout,
    full_state_dict,
    load_full_state_dict,
    sync_gradients,
)
from loomrl.parallel.allocations import AllocationGroups
from loomrl.parallel.spawn import run_world
from loomrl.plan.allocation import Allocation
from loomrl.rollout import Request, RolloutEngine, SamplingParams, stream_keys

WORLD = 2
TIMEOUT_S = 240
LR = 1e-3
MAX_NORM = 0.05
"""Small enough that the test gradients (norm ~1) are clipped."""

BUCKET_BYTES = 64 * 1024
"""Small buckets, so the ~4 MB of llama-1m gradients travel in many of them."""

# Right-padded rows of different lengths: 10, 7, 4 and 9 real tokens.
LENGTHS = (10, 7, 4, 9)


# ------------------------------------------------------------------------------------------ layout checks
def _error(layout: Layout, config: Any, devices: int) -> str:
    with pytest.raises(ConfigError) as info:
        check_layout(layout, config, devices, where="plan.actor")
    message = str(info.value)
    assert "\n" not in message
    return message


def test_check_layout_accepts_fitting_layouts():
    config = zoo_config("llama-1m", build_char_tokenizer())
    check_layout(Layout(tp=2), config, 2)
    check_layout(Layout(dp=2, tp=1), config, 2)
    check_layout(Layout(dp=2, pp=2), config, 4)  # 4 layers in 2 stages
    check_layout(Layout(tp=2, pp=2), config, 4)  # each of the 2 stages over 2 TP ranks
    check_layout(Layout(dp=2, tp=2, pp=4), config, 16)
    check_layout(Layout(dp=4), zoo_config("gpt2-1m", build_char_tokenizer()), 4)  # any model shards by data


def test_check_layout_errors_name_the_field_and_values():
    tok = build_char_tokenizer()
    llama = zoo_config("llama-1m", tok)
    assert _error(Layout(dp=2, tp=2), llama, 2) == "plan.actor: dp=2 × tp=2 × pp=1 = 4 devices, but the mesh has 2"
    assert _error(Layout(dp=1, pp=3), llama, 3) == "plan.actor.pp: 3 does not divide num_hidden_layers=4"
    # pp × tp: both the pipeline and the tensor checks apply.
    assert _error(Layout(tp=2, pp=3), llama, 6) == "plan.actor.pp: 3 does not divide num_hidden_layers=4"
    assert _error(Layout(tp=4, pp=2), llama, 8) == "plan.actor.tp: 4 does not divide num_key_value_heads=2"
    gpt2 = zoo_config("gpt2-1m", tok)
    assert "model_type 'gpt2' supports only pp=1" in _error(Layout(pp=2), gpt2, 2)
    assert "model_type 'gpt2' supports only pp=1" in _error(Layout(tp=2, pp=2), gpt2, 4)
    assert _error(Layout(tp=3), llama, 3) == "plan.actor.tp: 3 does not divide num_attention_heads=4"
    assert _error(Layout(tp=4), llama, 4) == "plan.actor.tp: 4 does not divide num_key_value_heads=2"
    odd_mlp = SimpleNamespace(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2, intermediate_size=510)
    assert (
        _error(Layout(tp=4), SimpleNamespace(**{**vars(odd_mlp), "num_key_value_heads": 4}), 4)
        == "plan.actor.tp: 4 does not divide intermediate_size=510"
    )
    gpt2 = _error(Layout(tp=2), zoo_config("gpt2-1m", tok), 2)
    assert "model_type 'gpt2'" in gpt2 and "llama, qwen2" in gpt2


def test_layout_rejects_non_positive_degrees():
    with pytest.raises(ConfigError, match="layout.tp: 0 is not a positive integer"):
        Layout(tp=0)


# ------------------------------------------------------------------------------------ multi-process harness
def _run_world(body: Callable[[int], dict]) -> list[dict]:
    return run_world(body, WORLD, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return _run_world(_all_checks)


# ------------------------------------------------------------------------------- checks run on every rank
def _all_checks(rank: int) -> dict:
    keys = {"actor": Allocation.parse("0-1:tp2"), "critic": Allocation.parse("0-1:dp2")}
    registry = AllocationGroups(rank, list(keys.values()), device_type="cpu")
    groups = {role: registry[key] for role, key in keys.items()}
    out: dict[str, Any] = {"groups": _describe_groups(groups, keys)}
    out["logits"] = {name: _tp_logits_diff(name, groups["actor"].tp_mesh) for name in ("llama-1m", "qwen2-1m")}
    out["engine"] = _tp_engine(groups["actor"].tp_mesh)
    out["values"] = _tp_values_diff(groups["actor"].tp_mesh)
    out["tp_step"] = _tp_adamw_step(groups["actor"].tp_mesh)
    out["tp_tied"] = _tp_tied_step(groups["actor"].tp_mesh)
    out["dp_step"] = _dp_adamw_step(rank, groups["critic"].dp_group)
    out["dp_dtensor"] = _dp_dtensor_grad(rank, groups["critic"])
    out["dp_missing"] = _dp_missing_grads(rank, groups["critic"].dp_group)
    return out


def _describe_groups(groups: dict, keys: dict) -> dict:
    described = {}
    for role, g in groups.items():
        layout = keys[role].layout
        described[role] = {
            "dp": (g.dp_rank, layout.dp, dist.get_process_group_ranks(g.dp_group)),
            "tp": (g.tp_rank, layout.tp, dist.get_process_group_ranks(g.tp_mesh.get_group())),
            "tp_mesh": g.tp_mesh.mesh.tolist(),
        }
    described["world"] = dist.get_process_group_ranks(dist.group.WORLD)
    return described


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids_BL = torch.randint(3, 48, (len(LENGTHS), max(LENGTHS)), generator=gen)
    mask_BL = (torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    return ids_BL.masked_fill(mask_BL == 0, 0), mask_BL


def _pair(name: str, tp_mesh: Any, tied: bool = False) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(unsharded reference, TP-sharded copy) of a causal LM built from the same seed."""
    pair = [build_causal_lm(name, build_char_tokenizer(), seed=0) for _ in range(2)]
    if tied:  # the zoo unties; real checkpoints (e.g. small Qwen2) tie input and output embeddings
        for model in pair:
            model.lm_head.weight = model.get_input_embeddings().weight
    return pair[0], apply_tensor_parallel(pair[1], tp_mesh)


def _tp_logits_diff(name: str, tp_mesh: Any) -> float:
    ref, tp = _pair(name, tp_mesh)
    ids_BL, mask_BL = _batch()
    with torch.no_grad():
        want = ref(input_ids=ids_BL, attention_mask=mask_BL).logits
        got = tp(input_ids=ids_BL, attention_mask=mask_BL).logits
    assert type(got) is torch.Tensor and got.shape == want.shape, "logits must be plain and full-vocabulary"
    return (got - want)[mask_BL.bool()].abs().max().item()


def _tp_engine(tp_mesh: Any) -> dict:
    ref, tp = _pair("llama-1m", tp_mesh)
    keys = stream_keys(7, 0, range(8)).tolist()
    requests = [Request(i, [1] + [4 + (5 * i + j) % 40 for j in range(2 + i)], keys[i]) for i in range(8)]
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    # Fewer slots than requests: admission, slot moves and cache reuse all happen on the sharded cache too.
    runs = [RolloutEngine(m, params, eos_id=2, pad_id=0, slots=3, max_len=64).generate(requests) for m in (ref, tp)]
    return {
        "tokens": [[c.tokens for c in run] for run in runs],
        "logp_diff": max(abs(a - b) for x, y in zip(*runs) for a, b in zip(x.logps, y.logps)),
    }


def _tp_values_diff(tp_mesh: Any) -> float:
    tok = build_char_tokenizer()
    ref, tp = build_value_model("llama-1m", tok, seed=0), build_value_model("llama-1m", tok, seed=0)
    for model in (ref, tp):  # the zoo's score head starts at zero, which would make any comparison pass
        with torch.no_grad():
            score_head(model).weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(3))
    apply_tensor_parallel(tp, tp_mesh)
    ids_BL, mask_BL = _batch()
    with torch.no_grad():
        want, got = token_values(ref, ids_BL, mask_BL), token_values(tp, ids_BL, mask_BL)
    assert want.abs().max() > 0.1
    return (got - want)[mask_BL.bool()].abs().max().item()


def _token_mean_nll(
    model: torch.nn.Module, ids_BL: torch.Tensor, mask_BL: torch.Tensor, total_tokens: int
) -> torch.Tensor:
    """Sum of next-token NLL over real tokens / total_tokens (the batch's own count for the reference)."""
    logp_BL1 = token_logprobs(model, ids_BL, mask_BL)
    return -(logp_BL1 * mask_BL[:, 1:]).sum() / total_tokens


def _step(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module], torch.Tensor],
    sync: Callable[[torch.nn.Module], None] | None = None,
) -> float:
    """One clipped AdamW step; returns the gradient norm before clipping."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    loss_fn(model).backward()
    if sync is not None:
        sync(model)
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
    opt.step()
    return norm


def _max_state_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _tp_adamw_step(tp_mesh: Any) -> dict:
    ref, tp = _pair("llama-1m", tp_mesh)
    ids_BL, mask_BL = _batch()
    tokens = int(mask_BL[:, 1:].sum())
    before = full_state_dict(ref)
    norms = [_step(m, lambda model: _token_mean_nll(model, ids_BL, mask_BL, tokens)) for m in (ref, tp)]
    stepped = full_state_dict(ref)
    result = {
        "norms": norms,
        "param_diff": _max_state_diff(stepped, full_state_dict(tp)),
        "moved": _max_state_diff(stepped, before),
    }
    load_full_state_dict(tp, before)  # back to the start: a load must undo the step exactly
    result["reload_diff"] = _max_state_diff(before, full_state_dict(tp))
    some = {k: stepped[k] for k in ("lm_head.weight", "model.layers.1.self_attn.k_proj.weight")}
    load_full_state_dict(tp, some, strict=False)
    now = full_state_dict(tp)
    result["partial_load"] = [
        _max_state_diff({k: now[k]}, {k: want[k]})
        for want in (stepped, before)
        for k in ("lm_head.weight", "model.norm.weight")
    ]
    return result


def _tp_tied_step(tp_mesh: Any) -> dict:
    ref, tp = _pair("qwen2-1m", tp_mesh, tied=True)
    ids_BL, mask_BL = _batch()
    tokens = int(mask_BL[:, 1:].sum())
    norms = [_step(m, lambda model: _token_mean_nll(model, ids_BL, mask_BL, tokens)) for m in (ref, tp)]
    return {
        "still_tied": tp.lm_head.weight is tp.get_input_embeddings().weight,
        "norms": norms,
        "param_diff": _max_state_diff(full_state_dict(ref), full_state_dict(tp)),
    }


def _dp_adamw_step(rank: int, dp_group: Any) -> dict:
    tok = build_char_tokenizer()
    ref, dp = build_causal_lm("llama-1m", tok, seed=0), build_causal_lm("llama-1m", tok, seed=0)
    ids_BL, mask_BL = _batch()
    total = int(mask_BL[:, 1:].sum())
    mine = slice(2 * rank, 2 * rank + 2)  # rank 0: 10 + 7 tokens, rank 1: 4 + 9: unequal shares
    # Local token-mean × local share = local sum / global count.
    norms = [
        _step(ref, lambda model: _token_mean_nll(model, ids_BL, mask_BL, total)),
        _step(
            dp,
            lambda model: _token_mean_nll(model, ids_BL[mine], mask_BL[mine], total),
            sync=lambda model: sync_gradients(model, dp_group, bucket_bytes=BUCKET_BYTES),
        ),
    ]
    stepped = full_state_dict(ref)
    return {"norms": norms, "param_diff": _max_state_diff(stepped, full_state_dict(dp))}


def _dp_dtensor_grad(rank: int, critic: Any) -> list[float]:
    """sync_gradients must write the sum into a DTensor gradient's local shard (here on the 1-rank tp mesh)."""
    layer = torch.nn.Linear(2, 1, bias=False)
    layer.weight = torch.nn.Parameter(distribute_tensor(torch.zeros(1, 2), critic.tp_mesh, [Replicate()]))
    layer.weight.grad = distribute_tensor(torch.full((1, 2), float(rank + 1)), critic.tp_mesh, [Replicate()])
    sync_gradients(layer, critic.dp_group)
    return layer.weight.grad.to_local().flatten().tolist()


def _dp_missing_grads(rank: int, dp_group: Any) -> list:
    """A rank without rows has no gradients; it must still join the sum, and unused parameters stay None."""
    layer = torch.nn.Linear(2, 1)
    if rank == 0:
        layer.weight.grad = torch.ones(1, 2)
    sync_gradients(layer, dp_group)
    return [None if p.grad is None else p.grad.flatten().tolist() for p in (layer.weight, layer.bias)]


# --------------------------------------------------------------------------------------- assertions
def test_allocation_groups_follow_each_layout(ranks):
    for rank, result in enumerate(ranks):
        groups = result["groups"]
        assert groups["actor"] == {"dp": (0, 1, [rank]), "tp": (rank, 2, [0, 1]), "tp_mesh": [0, 1]}
        assert groups["critic"] == {"dp": (rank, 2, [0, 1]), "tp": (0, 1, [rank]), "tp_mesh": [rank]}
        assert groups["world"] == [0, 1]


def test_tp_logits_equal_unsharded(ranks):
    for result in ranks:
        assert result["logits"]["llama-1m"] < 1e-5
        assert result["logits"]["qwen2-1m"] < 1e-5


def test_tp_rollout_engine_draws_the_same_tokens(ranks):
    for result in ranks:
        ref_tokens, tp_tokens = result["engine"]["tokens"]
        assert tp_tokens == ref_tokens
        assert result["engine"]["logp_diff"] < 1e-5
    assert ranks[0]["engine"]["tokens"] == ranks[1]["engine"]["tokens"]
    assert len({len(t) for t in ranks[0]["engine"]["tokens"][0]}) > 1, "samples should finish at different steps"


def test_tp_value_model_token_values_equal_unsharded(ranks):
    for result in ranks:
        assert result["values"] < 1e-5


def test_tp_adamw_step_with_clipping_equals_single_process(ranks):
    for result in ranks:
        ref_norm, tp_norm = result["tp_step"]["norms"]
        assert ref_norm > MAX_NORM * 5, "the step must actually clip"
        assert abs(tp_norm - ref_norm) < 1e-5 * ref_norm
        assert result["tp_step"]["moved"] > 1e-4
        assert result["tp_step"]["param_diff"] < 1e-5
        assert result["tp_step"]["reload_diff"] == 0.0
        # lm_head took the stepped weights, the final norm kept the initial ones.
        assert result["tp_step"]["partial_load"][0] == 0.0 and result["tp_step"]["partial_load"][3] == 0.0
        assert result["tp_step"]["partial_load"][1] > 0 and result["tp_step"]["partial_load"][2] > 0


def test_tp_keeps_tied_embeddings_one_parameter(ranks):
    for result in ranks:
        ref_norm, tp_norm = result["tp_tied"]["norms"]
        assert result["tp_tied"]["still_tied"]
        assert abs(tp_norm - ref_norm) < 1e-5 * ref_norm
        assert result["tp_tied"]["param_diff"] < 1e-5


def test_dp_summed_gradients_give_the_global_token_mean_step(ranks):
    for result in ranks:
        ref_norm, dp_norm = result["dp_step"]["norms"]
        assert ref_norm > MAX_NORM * 5
        assert abs(dp_norm - ref_norm) < 1e-5 * ref_norm
        assert result["dp_step"]["param_diff"] < 1e-5


def test_dp_sync_handles_dtensor_and_missing_gradients(ranks):
    for result in ranks:
        assert result["dp_dtensor"] == [3.0, 3.0]
        assert result["dp_missing"] == [[1.0, 1.0], None]


def _rank_one_is_killed(rank: int) -> int:
    if rank == 1:
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer would
    return rank


def test_run_world_reports_a_killed_rank_instead_of_waiting():
    with pytest.raises(RuntimeError, match="rank 1 died without a result .*killed"):
        run_world(_rank_one_is_killed, 2, timeout_s=120)


BF16_RANKS = 4


def _bf16_gradient_sum(rank: int) -> dict:
    """bf16 gradients of 4 ranks whose bf16 partial sums round differently from their exact sum."""
    layer = torch.nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    grads = [
        torch.randn(64, 64, generator=torch.Generator().manual_seed(r)).mul(1 + 7 * r).bfloat16()
        for r in range(BF16_RANKS)
    ]
    layer.weight.grad = grads[rank].clone()
    sync_gradients(layer, dist.group.WORLD)
    exact = sum(g.double() for g in grads).bfloat16()  # every rank's gradient summed exactly, rounded once
    in_bf16 = grads[0]
    for g in grads[1:]:
        in_bf16 = in_bf16 + g  # what summing in bf16 hop by hop gives
    got = layer.weight.grad
    return {
        "dtype": got.dtype,
        "vs_exact": float((got.double() - exact.double()).abs().max()),
        "bf16_sums_differ": bool((in_bf16 != exact).any()),
    }


def test_bf16_gradients_are_summed_in_fp32_and_rounded_once():
    for result in run_world(_bf16_gradient_sum, BF16_RANKS, timeout_s=TIMEOUT_S):
        assert result["dtype"] == torch.bfloat16
        assert result["bf16_sums_differ"], "the case must tell a bf16 sum from an fp32 one"
        assert result["vs_exact"] == 0.0, result


def test_bf16_gradients_accumulate_over_micro_batches_in_fp32():
    """A hooked bf16 parameter sums its micro-batches' gradients in fp32 (``main_grad``; ``.grad`` stays
    empty), where autograd alone would round the running sum to bf16 at each micro-batch."""
    from loomrl.parallel.main_grad import accumulate_in_fp32, clear_grad, grad_of, zero_fill

    torch.manual_seed(0)
    hooked, plain = (torch.nn.Linear(32, 16, bias=False).to(torch.bfloat16) for _ in range(2))
    plain.load_state_dict(hooked.state_dict())
    assert accumulate_in_fp32(hooked) == 1 and accumulate_in_fp32(torch.nn.Linear(4, 4)) == 0  # fp32: untouched
    xs = [torch.randn(8, 32).mul(1 + 5 * k).bfloat16() for k in range(4)]
    singles = []
    for x in xs:
        one = torch.nn.Linear(32, 16, bias=False).to(torch.bfloat16)
        one.load_state_dict(hooked.state_dict())
        one(x).float().sum().backward()
        singles.append(one.weight.grad)
        hooked(x).float().sum().backward()
        plain(x).float().sum().backward()
    exact = sum(g.double() for g in singles).float()
    assert hooked.weight.grad is None and grad_of(hooked.weight).dtype == torch.float32
    assert torch.equal(grad_of(hooked.weight), exact)
    assert not torch.equal(plain.weight.grad.float(), exact), "the case must tell bf16 accumulation apart"
    clear_grad(hooked.weight)
    assert grad_of(hooked.weight) is None
    zero_fill(hooked.weight)
    assert grad_of(hooked.weight).dtype == torch.float32 and not grad_of(hooked.weight).any()
