"""Pipeline × tensor parallelism (pp=2 × tp=2 on four gloo ranks) against the unsplit single-process model.

One spawn of four processes runs every check: the allocation (pp, dp, tp) = (2, 1, 2) puts ranks 0, 1 on
stage 0 and ranks 2, 3 on stage 1, each stage tensor-parallel over its two ranks. Every rank also builds the
unsplit model from the same seed, compares against it and sends plain numbers back; the tests assert on them
in the parent. The shards each rank holds are compared with :mod:`loomrl.plan.shards`, the convention the
reallocation planner and executor rely on.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from loomrl.models.tokenizer import build_char_tokenizer
from loomrl.models.zoo import build_causal_lm
from loomrl.parallel import apply_tensor_parallel, full_state_dict
from loomrl.parallel.allocations import AllocationGroups
from loomrl.parallel.pipeline import split_stages
from loomrl.parallel.pipeline_runner import PipelineRunner
from loomrl.parallel.spawn import run_world
from loomrl.plan.allocation import Allocation
from loomrl.plan.shards import shard_intervals, shard_shape
from pipeline_helpers import (
    MAX_NORM,
    adamw_steps,
    ragged_batch,
    tied_model,
    value_model,
    values_diff,
)

WORLD = 4
TIMEOUT_S = 300
KEY = Allocation.parse("0-3:dp1tp2pp2")
NUM_LAYERS = 4
"""llama-1m's decoder layers: two per stage."""


def _staged(model: torch.nn.Module, groups: Any) -> PipelineRunner:
    """What the runtime worker does for a pp×tp allocation: split the stage, then shard it over its TP mesh."""
    stage = split_stages(model, groups.pp_rank, KEY.layout.pp)
    apply_tensor_parallel(stage.model, groups.tp_mesh)
    return PipelineRunner(stage, groups.pp_group, groups.pp_rank, KEY.layout.pp, tied_group=groups.tied_group)


# ------------------------------------------------------------------------------- checks run on every rank
def _all_checks(rank: int) -> dict:
    groups = AllocationGroups(rank, [KEY], device_type="cpu")[KEY]
    return {
        "groups": {
            "coords": (groups.pp_rank, groups.dp_rank, groups.tp_rank),
            "pp": dist.get_process_group_ranks(groups.pp_group),
            "tp": dist.get_process_group_ranks(groups.tp_mesh.get_group()),
        },
        "logits": _logits_diffs(groups),
        "values": _values_diff(groups),
        "step": _adamw_step(rank, groups),
        "tied_step": _adamw_step(rank, groups, tied=True),
    }


def _logits_diffs(groups: Any) -> dict:
    tok = build_char_tokenizer()
    ref = build_causal_lm("llama-1m", tok, seed=0)
    runner = _staged(build_causal_lm("llama-1m", tok, seed=0), groups)
    ids_BL, mask_BL = ragged_batch()
    with torch.no_grad():
        want = ref(input_ids=ids_BL, attention_mask=mask_BL).logits
    out: dict[Any, Any] = {}
    for m in (1, 3):  # 3 micro-batches of 4 rows: unequal sizes
        got = runner.forward(ids_BL, mask_BL, micro_batches=m, broadcast_result=True)
        out[m] = (got - want).abs().max().item()
    names = {name for name, _ in runner.stage.named_parameters()}
    out["embed_on_stage"] = "model.embed_tokens.weight" in names
    out["head_on_stage"] = "lm_head.weight" in names
    return out


def _values_diff(groups: Any) -> float:
    return values_diff(value_model(), _staged(value_model(), groups))


def _shards_follow_the_plan(
    rank: int, stage_model: torch.nn.Module, full: dict[str, torch.Tensor], tied: bool = False
) -> list[str]:
    """Parameters whose local tensor is not the slice :func:`shard_intervals` assigns this rank (want none)."""
    layout, wrong = KEY.layout, []
    for name, param in stage_model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        flat = full[name].reshape(-1)
        intervals = shard_intervals(name, full[name].shape, layout, rank, NUM_LAYERS, tied=tied)
        expected = torch.cat([flat[lo:hi] for lo, hi in intervals])
        if shard_shape(name, full[name].shape, layout, rank, NUM_LAYERS, tied=tied) != tuple(
            local.shape
        ) or not torch.equal(local.detach().reshape(-1), expected):
            wrong.append(name)
    return wrong


def _adamw_step(rank: int, groups: Any, tied: bool = False) -> dict:
    """One clipped AdamW step on the token-mean NLL: unsplit full batch vs 2 stages × 2 TP ranks × 2 micro-batches
    (with ``tied``, of a model whose head shares its embedding: both stages hold its TP shards)."""
    tok = build_char_tokenizer()
    ref = tied_model() if tied else build_causal_lm("llama-1m", tok, seed=0)
    runner = _staged(tied_model() if tied else build_causal_lm("llama-1m", tok, seed=0), groups)
    stage = runner.stage
    before = full_state_dict(ref)
    out: dict[str, Any] = {"misplaced": _shards_follow_the_plan(rank, stage.model, before, tied)}
    losses, norms = adamw_steps(ref, runner, groups.pp_group)
    stepped, mine = full_state_dict(ref), full_state_dict(stage.model)  # the latter: collective over TP
    out.update(
        {
            "losses": losses,
            "norms": norms,
            "state_keys": sorted(mine),
            "all_keys": sorted(stepped),
            "param_diff": max((mine[n] - stepped[n]).abs().max().item() for n in mine),
            "moved": max((mine[n] - before[n]).abs().max().item() for n in mine),
        }
    )
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_world(_all_checks, WORLD, timeout_s=TIMEOUT_S)


# --------------------------------------------------------------------------------------- assertions
def test_pp_groups_join_the_same_tp_rank_of_every_stage(ranks):
    for rank, result in enumerate(ranks):
        pp_rank, tp_rank = divmod(rank, 2)
        assert result["groups"] == {
            "coords": (pp_rank, 0, tp_rank),
            "pp": [tp_rank, tp_rank + 2],
            "tp": [2 * pp_rank, 2 * pp_rank + 1],
        }, rank


def test_pp_tp_logits_equal_unsplit(ranks):
    for rank, result in enumerate(ranks):
        assert all(result["logits"][m] < 1e-5 for m in (1, 3)), (rank, result["logits"])
        assert result["logits"]["embed_on_stage"] == (rank < 2)
        assert result["logits"]["head_on_stage"] == (rank >= 2)


def test_pp_tp_value_model_token_values_equal_unsplit(ranks):
    for result in ranks:
        assert result["values"] < 1e-5


@pytest.mark.parametrize("step", ["step", "tied_step"], ids=["untied", "tied"])
def test_pp_tp_shards_are_those_the_reallocation_plan_assigns(ranks, step):
    for rank, result in enumerate(ranks):
        assert result[step]["misplaced"] == [], rank
    assert "model.embed_tokens.weight" in ranks[-1]["tied_step"]["state_keys"]  # the last stage's copy


@pytest.mark.parametrize("name", ["step", "tied_step"], ids=["untied", "tied"])
def test_pp_tp_adamw_step_with_clipping_equals_single_process(ranks, name):
    for result in ranks:
        step = result[name]
        (ref_loss, loss), (ref_norm, norm) = step["losses"], step["norms"]
        assert abs(loss - ref_loss) < 1e-5 * abs(ref_loss)
        assert ref_norm > MAX_NORM * 5, "the step must actually clip"
        assert abs(norm - ref_norm) < 1e-5 * ref_norm  # global: TP shards once, replicated params once
        assert step["moved"] > 1e-4
        assert step["param_diff"] < 1e-5


def test_pp_tp_full_state_dicts_of_the_stages_make_up_the_whole_model(ranks):
    stage_keys = [set(result["step"]["state_keys"]) for result in ranks]
    assert stage_keys[0] == stage_keys[1] and stage_keys[2] == stage_keys[3]  # TP ranks gather the same
    assert not stage_keys[0] & stage_keys[2]
    assert sorted(stage_keys[0] | stage_keys[2]) == ranks[0]["step"]["all_keys"]
