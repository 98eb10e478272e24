"""Pipeline parallelism (pp=2 on gloo) against the unsplit single-process model.

Stage splitting (names, the error for an uneven split, stages chained in one process) is checked without any
spawn. One spawn of two processes runs every multi-process check: each rank holds one stage of llama-1m
(4 layers, 2 per stage) and an unsplit copy built from the same seed, runs the GPipe schedule with its peer and
sends plain numbers back; the tests assert on them in the parent.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from loomrl.parallel.spawn import run_world

from loomrl.errors import ConfigError
from loomrl.models.heads import score_head, token_logprobs, token_values
from loomrl.models.tokenizer import build_char_tokenizer
from loomrl.models.zoo import build_causal_lm, build_value_model
from loomrl.parallel.pipeline import check_pipeline, split_stages
from loomrl.parallel.pipeline_schedule import PipelineRunner, clip_grad_norm_pp, micro_batch_slices

WORLD = 2
TIMEOUT_S = 240
LR = 1e-3
MAX_NORM = 0.05
"""Small enough that the test gradients (norm ~1) are clipped."""

# Right-padded rows of different lengths: 10, 7, 4 and 9 real tokens.
LENGTHS = (10, 7, 4, 9)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids_BL = torch.randint(3, 48, (len(LENGTHS), max(LENGTHS)), generator=gen)
    mask_BL = (torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    return ids_BL.masked_fill(mask_BL == 0, 0), mask_BL


def _logp_from_logits(logits_BLV: torch.Tensor, ids_BL: torch.Tensor) -> torch.Tensor:
    """What loomrl.models.heads.token_logprobs computes, from logits instead of a model (temperature 1)."""
    logits_BL1V = logits_BLV[:, :-1].float()
    picked_BL1 = logits_BL1V.gather(-1, ids_BL[:, 1:].unsqueeze(-1)).squeeze(-1)
    return picked_BL1 - torch.logsumexp(logits_BL1V, dim=-1)


def _value_model() -> torch.nn.Module:
    model = build_value_model("llama-1m", build_char_tokenizer(), seed=0)
    with torch.no_grad():  # the zoo's score head starts at zero, which would make any comparison pass
        score_head(model).weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(3))
    return model


# ------------------------------------------------------------------------------ single-process checks
def test_micro_batch_slices_cover_rows_contiguously():
    assert micro_batch_slices(5, 2) == [slice(0, 3), slice(3, 5)]
    assert micro_batch_slices(4, 4) == [slice(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match="between 1 and the number of rows"):
        micro_batch_slices(2, 3)


@pytest.mark.parametrize("kind", ["causal_lm", "value"])
def test_stages_keep_global_names_and_partition_the_model(kind):
    def build() -> torch.nn.Module:
        return build_causal_lm("llama-1m", build_char_tokenizer(), seed=0) if kind == "causal_lm" else _value_model()

    full = {name for name, _ in build().named_parameters()}
    stages = [split_stages(build(), rank, 2) for rank in range(2)]
    names = [{name for name, _ in stage.named_parameters()} for stage in stages]
    assert names[0] | names[1] == full and not names[0] & names[1]
    layers = [{int(n.split(".")[2]) for n in ns if n.startswith("model.layers.")} for ns in names]
    assert layers == [{0, 1}, {2, 3}]
    assert stages[0].layer_ids == (0, 1) and stages[1].layer_ids == (2, 3)
    head = "lm_head.weight" if kind == "causal_lm" else "score.weight"
    assert {"model.embed_tokens.weight"} <= names[0] and {"model.norm.weight", head} <= names[1]
    assert {stage.output for stage in stages} == {"logits" if kind == "causal_lm" else "values"}


def test_uneven_or_unsupported_split_is_a_one_line_error():
    tok = build_char_tokenizer()
    with pytest.raises(ConfigError) as info:
        split_stages(build_causal_lm("llama-1m", tok, seed=0), 0, 3)
    assert str(info.value) == "pipeline.pp: 3 does not divide num_hidden_layers=4"
    with pytest.raises(ConfigError) as info:
        check_pipeline(build_causal_lm("gpt2-1m", tok, seed=0).config, 2, where="plan.actor")
    assert "\n" not in str(info.value) and "model_type 'gpt2' supports only pp=1" in str(info.value)
    tied = build_causal_lm("qwen2-1m", tok, seed=0)
    tied.lm_head.weight = tied.get_input_embeddings().weight
    with pytest.raises(ConfigError, match="tied input/output embeddings"):
        split_stages(tied, 1, 2)


@pytest.mark.parametrize("name", ["llama-1m", "qwen2-1m"])
def test_stages_chained_in_one_process_equal_the_model(name):
    tok = build_char_tokenizer()
    ref = build_causal_lm(name, tok, seed=0)
    first, last = (split_stages(build_causal_lm(name, tok, seed=0), rank, 2) for rank in range(2))
    ids_BL, mask_BL = _batch()
    with torch.no_grad():
        want = ref(input_ids=ids_BL, attention_mask=mask_BL).logits
        got = last.forward(first.forward(ids_BL, mask_BL), mask_BL)
        # pp=1: one stage holding everything, run by a runner that never communicates.
        whole = PipelineRunner(split_stages(build_causal_lm(name, tok, seed=0), 0, 1), None, 0, 1)
        single = whole.forward(ids_BL, mask_BL, micro_batches=2)
    assert (got - want).abs().max().item() < 1e-5
    assert (single - want).abs().max().item() < 1e-5


# ------------------------------------------------------------------------------------ multi-process harness
def _run_world(body: Callable[[int], dict]) -> list[dict]:
    return run_world(body, WORLD, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return _run_world(_all_checks)


# ------------------------------------------------------------------------------- checks run on every rank
def _all_checks(rank: int) -> dict:
    # A subgroup rather than WORLD, so group ranks and global ranks are both exercised by send/recv.
    group = dist.new_group([0, 1])
    return {"logits": _logits_diffs(rank, group), "logp": _logp_diff(rank, group),
            "values": _values_diff(rank, group), "step": _adamw_step(rank, group)}


def _runner(model: torch.nn.Module, rank: int, group: Any) -> PipelineRunner:
    return PipelineRunner(split_stages(model, rank, WORLD), group, rank, WORLD)


def _logits_diffs(rank: int, group: Any) -> dict:
    tok = build_char_tokenizer()
    ref = build_causal_lm("llama-1m", tok, seed=0)
    runner = _runner(build_causal_lm("llama-1m", tok, seed=0), rank, group)
    ids_BL, mask_BL = _batch()
    with torch.no_grad():
        want = ref(input_ids=ids_BL, attention_mask=mask_BL).logits
    out: dict[str, Any] = {}
    for m in (1, 2, 3):  # 3 micro-batches of 4 rows: unequal sizes
        got = runner.forward(ids_BL, mask_BL, micro_batches=m, broadcast_result=True)
        out[m] = (got - want).abs().max().item()
    plain = runner.forward(ids_BL if rank == 0 else None, mask_BL, micro_batches=2)
    out["plain"] = None if plain is None else (plain - want).abs().max().item()
    return out


def _logp_diff(rank: int, group: Any) -> float:
    tok = build_char_tokenizer()
    ref = build_causal_lm("llama-1m", tok, seed=0)
    runner = _runner(build_causal_lm("llama-1m", tok, seed=0), rank, group)
    ids_BL, mask_BL = _batch()
    rows = micro_batch_slices(len(LENGTHS), 2)
    got = runner.forward(ids_BL, mask_BL, micro_batches=2, broadcast_result=True,
                         output_fn=lambda logits, k: _logp_from_logits(logits, ids_BL[rows[k]]))
    with torch.no_grad():
        want = token_logprobs(ref, ids_BL, mask_BL)
    assert got.shape == want.shape
    return (got - want)[mask_BL[:, 1:].bool()].abs().max().item()


def _values_diff(rank: int, group: Any) -> float:
    ref, runner = _value_model(), _runner(_value_model(), rank, group)
    ids_BL, mask_BL = _batch()
    got = runner.forward(ids_BL, mask_BL, micro_batches=2, broadcast_result=True)
    with torch.no_grad():
        want = token_values(ref, ids_BL, mask_BL)
    assert want.abs().max() > 0.1 and got.shape == want.shape
    return (got - want)[mask_BL.bool()].abs().max().item()


def _adamw_step(rank: int, group: Any) -> dict:
    """One clipped AdamW step on the token-mean NLL: unsplit full batch vs two stages × two micro-batches."""
    tok = build_char_tokenizer()
    ref = build_causal_lm("llama-1m", tok, seed=0)
    runner = _runner(build_causal_lm("llama-1m", tok, seed=0), rank, group)
    ids_BL, mask_BL = _batch()
    total = int(mask_BL[:, 1:].sum())
    before = {name: p.detach().clone() for name, p in ref.named_parameters()}
    ref.train()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    ref_loss = -(token_logprobs(ref, ids_BL, mask_BL) * mask_BL[:, 1:]).sum() / total
    ref_loss.backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
    ref_opt.step()

    stage = runner.stage
    stage.model.train()
    opt = torch.optim.AdamW(stage.parameters(), lr=LR, weight_decay=0.1)
    rows = micro_batch_slices(len(LENGTHS), 2)

    def loss_fn(logits_BLV: torch.Tensor, k: int) -> torch.Tensor:
        # Divided by the whole batch's token count, so the micro-batch losses sum to the full-batch loss.
        return -(_logp_from_logits(logits_BLV, ids_BL[rows[k]]) * mask_BL[rows[k], 1:]).sum() / total

    loss = runner.train_step_backward(ids_BL, mask_BL, loss_fn, micro_batches=2, broadcast_result=True)
    norm = clip_grad_norm_pp(stage, MAX_NORM, group)
    opt.step()
    stepped = dict(ref.named_parameters())
    return {"losses": (float(ref_loss), loss), "norms": (ref_norm, norm),
            "param_diff": max((p - stepped[n]).abs().max().item() for n, p in stage.named_parameters()),
            "moved": max((p - before[n]).abs().max().item() for n, p in stage.named_parameters())}


# --------------------------------------------------------------------------------------- assertions
def test_pp_logits_equal_unsplit_for_any_micro_batching(ranks):
    for result in ranks:
        assert all(result["logits"][m] < 1e-5 for m in (1, 2, 3))
    assert ranks[0]["logits"]["plain"] is None, "without broadcast only the last stage has the result"
    assert ranks[1]["logits"]["plain"] < 1e-5


def test_pp_token_logprobs_equal_heads_on_the_unsplit_model(ranks):
    for result in ranks:
        assert result["logp"] < 1e-5


def test_pp_value_model_token_values_equal_unsplit(ranks):
    for result in ranks:
        assert result["values"] < 1e-5


def test_pp_adamw_step_with_clipping_equals_single_process(ranks):
    for result in ranks:
        ref_loss, pp_loss = result["step"]["losses"]
        ref_norm, pp_norm = result["step"]["norms"]
        assert abs(pp_loss - ref_loss) < 1e-5 * abs(ref_loss)
        assert ref_norm > MAX_NORM * 5, "the step must actually clip"
        assert abs(pp_norm - ref_norm) < 1e-5 * ref_norm
        assert result["step"]["moved"] > 1e-4
        assert result["step"]["param_diff"] < 1e-5
