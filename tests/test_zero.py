"""ZeRO-1 (loomrl/parallel/zero.py): AdamW with its state sharded over the data-parallel group computes the
same updates and the same full checkpoint state as one unsharded AdamW."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from loomrl.models.tokenizer import build_char_tokenizer
from loomrl.models.zoo import build_causal_lm
from loomrl.parallel.spawn import run_world
from loomrl.parallel.zero import ZeroAdamW

WORLD = 2
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
STEPS = 3


def _model() -> torch.nn.Module:
    return build_causal_lm("llama-1m", build_char_tokenizer(), 0)


def _gradients(model: torch.nn.Module, step: int) -> None:
    """The same gradients on every rank (what the summed all-reduce leaves), different at each step; one
    parameter gets none at step 0, so its state starts a step later."""
    gen = torch.Generator().manual_seed(step)
    for name, p in model.named_parameters():
        p.grad = None if step == 0 and name == "model.norm.weight" else torch.randn(p.shape, generator=gen)


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
        "steps_match": all(float(full["state"][n]["step"]) == float(st["step"]) for n, st in reference["state"].items()),
        "moments_vs_adamw": _max_diff(moments, want) if moments.keys() == want.keys() else float("inf"),
        "groups_match": {k: v for k, v in full["param_groups"][0].items() if k != "params"}
        == {k: v for k, v in reference["param_groups"][0].items() if k != "params"},
        "resumed_vs_original": _max_diff({n: p.detach() for n, p in resumed_model.named_parameters()},
                                         {n: p.detach() for n, p in model.named_parameters()}),
        "owned": owned, "total": sum(p.numel() for p in model.parameters()),
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
    return _max_diff({n: p.detach() for n, p in mine.named_parameters()},
                     {n: p.detach() for n, p in model.named_parameters()}) < 1e-6
