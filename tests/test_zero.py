"""ZeRO-1 (loomrl/parallel/zero.py): AdamW with its state sharded over the data-parallel group computes the
same updates and the same full checkpoint state as one unsharded AdamW; with bf16 weights its fp32 master
weights follow exactly what one fp32 AdamW does from the same bf16 start and bf16 gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from loomrl.models.tokenizer import build_char_tokenizer
from loomrl.models.zoo import build_causal_lm
from loomrl.parallel.spawn import run_world
from loomrl.parallel.zero import ZeroAdamW
from loomrl.plan.memory import optimizer_bytes_per_param

WORLD = 2
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
STEPS = 3


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return build_causal_lm("llama-1m", build_char_tokenizer(), 0).to(dtype)


def _gradients(model: torch.nn.Module, step: int, rounded_to: torch.dtype | None = None) -> None:
    """The same gradients on every rank (what the summed all-reduce leaves), different at each step; one
    parameter gets none at step 0, so its state starts a step later. ``rounded_to``: values a gradient of that
    dtype can hold (what a bf16 backward gives), in the parameter's dtype."""
    gen = torch.Generator().manual_seed(step)
    for name, p in model.named_parameters():
        grad = torch.randn(p.shape, generator=gen)
        grad = grad if rounded_to is None else grad.to(rounded_to)
        p.grad = None if step == 0 and name == "model.norm.weight" else grad.to(p.dtype)


def _reference() -> tuple[torch.nn.Module, dict]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        _gradients(model, step)
        opt.step()
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return model, full


def _sharded_run() -> tuple[torch.nn.Module, ZeroAdamW]:
    """STEPS sharded steps over the world group, from the same start and gradients as :func:`_reference`."""
    model = _model()
    opt = ZeroAdamW(model.named_parameters(), dist.group.WORLD, **HYPER)
    for step in range(STEPS):
        opt.zero_grad()
        _gradients(model, step)
        opt.step()
    return model, opt


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _body(rank: int) -> dict:
    """Compared inside the rank (tensors do not cross the spawn queue): max differences and flags."""
    ref_model, reference = _reference()
    model, opt = _sharded_run()
    owned = sum(st["exp_avg"].numel() for st in opt.inner.state.values())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    full = opt.full_state_dict()
    # a fresh sharded optimizer resumes from the full state and steps on like the one that wrote it
    resumed_model = _model()
    resumed_model.load_state_dict(model.state_dict())
    resumed = ZeroAdamW(resumed_model.named_parameters(), dist.group.WORLD, **HYPER)
    resumed.load_full_state_dict(full)
    for m, o in ((model, opt), (resumed_model, resumed)):
        o.zero_grad()
        _gradients(m, STEPS)
        o.step()
    moments = {f"{n}.{k}": v for n, st in full["state"].items() for k, v in st.items() if k != "step"}
    want = {f"{n}.{k}": v for n, st in reference["state"].items() for k, v in st.items() if k != "step"}
    return {
        "params_vs_adamw": _max_diff(params, {n: p.detach() for n, p in ref_model.named_parameters()}),
        "state_keys_match": set(full["state"]) == set(reference["state"]),
        "steps_match": all(
            float(full["state"][n]["step"]) == float(st["step"]) for n, st in reference["state"].items()
        ),
        "moments_vs_adamw": _max_diff(moments, want) if moments.keys() == want.keys() else float("inf"),
        "groups_match": {k: v for k, v in full["param_groups"][0].items() if k != "params"}
        == {k: v for k, v in reference["param_groups"][0].items() if k != "params"},
        "resumed_vs_original": _max_diff(
            {n: p.detach() for n, p in resumed_model.named_parameters()},
            {n: p.detach() for n, p in model.named_parameters()},
        ),
        "owned": owned,
        "total": sum(p.numel() for p in model.parameters()),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_world(_body, WORLD, timeout_s=300)


def test_sharded_adamw_updates_like_one_adamw(ranks):
    for result in ranks:  # every rank holds the whole updated weights: the unsharded optimizer's
        assert result["params_vs_adamw"] < 1e-6, result
    assert sum(r["owned"] for r in ranks) == ranks[0]["total"]  # each element's moments live on one rank


def test_full_state_matches_the_unsharded_optimizer_and_resumes(ranks):
    for result in ranks:
        assert result["state_keys_match"] and result["steps_match"] and result["groups_match"], result
        assert result["moments_vs_adamw"] < 1e-6, result
        assert result["resumed_vs_original"] == 0.0, result


def test_parameters_after_steps_match_one_adamw():
    """Single rank group of one: ZeroAdamW degenerates to AdamW exactly (no chunking)."""
    assert run_world(_single, 1, timeout_s=120) == [True]


def _single(rank: int) -> bool:
    model, _ = _reference()
    mine, _ = _sharded_run()
    return (
        _max_diff(
            {n: p.detach() for n, p in mine.named_parameters()}, {n: p.detach() for n, p in model.named_parameters()}
        )
        < 1e-6
    )


# ------------------------------------------------------------------------------ bf16 weights, fp32 master weights
def _mixed_reference() -> torch.nn.Module:
    """One fp32 AdamW from the bf16 model's start, stepped with bf16-representable gradients."""
    model = _model()
    model.load_state_dict({k: v.float() for k, v in _model(torch.bfloat16).state_dict().items()})
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        _gradients(model, step, torch.bfloat16)
        opt.step()
    return model


def _mixed_body(rank: int, sharded: bool = True) -> dict:
    group = dist.group.WORLD if sharded else None  # read once the process group exists
    reference = {n: p.detach() for n, p in _mixed_reference().named_parameters()}
    model = _model(torch.bfloat16)
    opt = ZeroAdamW(model.named_parameters(), group, **HYPER)
    for step in range(STEPS):
        opt.zero_grad()
        _gradients(model, step, torch.bfloat16)
        opt.step()
    full = opt.full_state_dict()
    masters = {n: st["master"] for n, st in full["state"].items()}
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    # resuming: weights first, then the state; the master weights come back from the state, not the bf16 weights
    resumed_model = _model(torch.bfloat16)
    resumed_model.load_state_dict(model.state_dict())
    resumed = ZeroAdamW(resumed_model.named_parameters(), group, **HYPER)
    resumed.load_full_state_dict(full)
    for m, o in ((model, opt), (resumed_model, resumed)):
        o.zero_grad()
        _gradients(m, STEPS, torch.bfloat16)
        o.step()
    # an fp32 optimizer resumes a bf16 run's state (it has no master weights: its weights are the master)
    from loomrl.checkpoint.optim_state import FullOptimizerState

    fp32_model = _model()
    fp32_model.load_state_dict(masters, strict=False)
    fp32_opt = torch.optim.AdamW(fp32_model.parameters(), **HYPER)
    FullOptimizerState(fp32_model, fp32_opt).load_state_dict(full)
    loaded_fp32 = {k for st in fp32_opt.state.values() for k in st}
    return {
        "weights": {n: w.dtype for n, w in weights.items()},
        "master_dtypes": {m.dtype for m in masters.values()},
        "master_vs_adamw": _max_diff(masters, reference),
        "weights_are_rounded_master": max(
            float((weights[n].float() - m.bfloat16().float()).abs().max()) for n, m in masters.items()
        ),
        "every_param_has_master": set(masters) == set(weights),
        "moments_fp32": all(
            st[k].dtype == torch.float32 for st in full["state"].values() for k in ("exp_avg", "exp_avg_sq")
        ),
        "resumed_vs_original": _max_diff(
            {n: p.detach() for n, p in resumed_model.named_parameters()},
            {n: p.detach() for n, p in model.named_parameters()},
        ),
        "fp32_state_keys": sorted(loaded_fp32),
        # what the optimizer holds on this rank: fp32 moments and master chunks (the memory model's 12 bytes)
        "optimizer_bytes": sum(
            t.numel() * t.element_size()
            for shard, st in opt.inner.state.items()
            for t in (shard, st["exp_avg"], st["exp_avg_sq"])
        ),
        "params": sum(w.numel() for w in weights.values()),
    }


def _mixed_single(rank: int) -> dict:
    return _mixed_body(rank, sharded=False)


@pytest.mark.parametrize("world", [1, 2], ids=["unsharded", "zero_dp2"])
def test_bf16_weights_follow_fp32_master_weights(world):
    """bf16 weights get fp32 master weights (unsharded, or ZeRO-sharded over dp2): the masters equal one fp32
    AdamW's parameters, the weights are the masters rounded, the checkpoint state holds the masters, and a
    resumed optimizer continues exactly."""
    results = run_world(_mixed_single if world == 1 else _mixed_body, world, timeout_s=300)
    for result in results:
        assert set(result["weights"].values()) == {torch.bfloat16}, result
        assert result["master_dtypes"] == {torch.float32} and result["every_param_has_master"], result
        assert result["master_vs_adamw"] < 1e-6, result
        assert result["weights_are_rounded_master"] == 0.0, result
        assert result["moments_fp32"], result
        assert result["resumed_vs_original"] == 0.0, result
        assert result["fp32_state_keys"] == ["exp_avg", "exp_avg_sq", "step"], result
        # the planner's memory model (plan/memory.py) counts exactly this: 12 bytes per parameter, over dp ranks
        assert result["optimizer_bytes"] == pytest.approx(
            optimizer_bytes_per_param(2) * result["params"] / world, rel=1e-3
        ), result
