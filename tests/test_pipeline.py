"""Pipeline parallelism (pp=2 on gloo) against the unsplit single-process model.

Stage splitting (names, the error for an uneven split, stages chained in one process) is checked without any
spawn. One spawn of two processes runs every multi-process check: each rank holds one stage of llama-1m
(4 layers, 2 per stage) and an unsplit copy built from the same seed, runs the GPipe schedule with its peer and
sends plain numbers back; the tests assert on them in the parent. The MFC ops (:mod:`loomrl.algorithms.ops`)
are checked there too: with the plan's micro-batches, a staged role's log-probs, values, gradients and
statistics are those of the unsplit model run as one micro-batch.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist

from loomrl.algorithms.context import OpContext, Role
from loomrl.algorithms.ops import logprob_op, train_loop, values_op
from loomrl.algorithms.workflows import _actor_loss, _critic_loss
from loomrl.config.schema import AlgoConfig
from loomrl.errors import ConfigError
from loomrl.models.heads import response_outputs, token_logprobs
from loomrl.models.tokenizer import build_char_tokenizer
from loomrl.models.zoo import build_causal_lm
from loomrl.parallel.allocations import AllocationGroups
from loomrl.parallel.pipeline import check_pipeline, split_stages
from loomrl.parallel.pipeline_runner import PipelineRunner
from loomrl.parallel.spawn import run_world
from loomrl.plan.allocation import Allocation
from loomrl.plan.model_shape import ModelShape
from loomrl.role import ModelPasses
from loomrl.workflow.batch import (
    Batch,
    micro_batch_slices,
    pack_sequences,
    padded_micro_batch_slices,
    response_mask,
    response_width,
)
from pipeline_helpers import (
    LENGTHS,
    MAX_NORM,
    adamw_steps,
    logp_from_logits,
    ragged_batch,
    tied_model,
    value_model,
    values_diff,
)

WORLD = 2
TIMEOUT_S = 240


# ------------------------------------------------------------------------------ single-process checks
def test_micro_batch_slices_cover_rows_contiguously():
    assert micro_batch_slices(5, 2) == [slice(0, 3), slice(3, 5)]
    assert micro_batch_slices(4, 4) == [slice(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match="between 1 and the number of rows"):
        micro_batch_slices(2, 3)


def _padded(lengths: list[int], parts: list[slice]) -> int:
    return sum((c.stop - c.start) * lengths[c.stop - 1] for c in parts)


def test_padded_micro_batches_are_the_cheapest_contiguous_cut():
    """Against every cut of small sorted batches: as few padded tokens as the best, contiguous, none empty; a
    heavy tail gets micro-batches of its own; bad input is refused."""
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        lengths = sorted(rng.randint(1, 60) for _ in range(n))
        parts = padded_micro_batch_slices(lengths, k)
        assert len(parts) == k and parts[0].start == 0 and parts[-1].stop == n
        assert all(a.stop == b.start and a.stop > a.start for a, b in zip(parts, parts[1:]))
        cuts = itertools.combinations(range(1, n), k - 1)
        best = min(_padded(lengths, [slice(a, b) for a, b in itertools.pairwise((0, *c, n))]) for c in cuts)
        assert _padded(lengths, parts) == best, (lengths, k, parts)
    tail = [4] * 31 + [640]
    assert padded_micro_batch_slices(tail, 4)[-1] == slice(31, 32)
    assert _padded(tail, padded_micro_batch_slices(tail, 4)) < _padded(tail, micro_batch_slices(32, 4)) / 4
    with pytest.raises(ValueError, match="sorted"):
        padded_micro_batch_slices([3, 1], 2)
    with pytest.raises(ValueError, match="between 1 and the number of rows"):
        padded_micro_batch_slices([1, 2], 3)


@pytest.mark.parametrize("kind", ["causal_lm", "value"])
def test_stages_keep_global_names_and_partition_the_model(kind):
    def build() -> torch.nn.Module:
        return build_causal_lm("llama-1m", build_char_tokenizer(), seed=0) if kind == "causal_lm" else value_model()

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


@pytest.mark.parametrize("name", ["llama-1m", "qwen2-1m"])
def test_a_tied_embedding_lives_on_the_first_and_the_last_stage(name):
    """The first stage looks tokens up in it, the last projects onto it (still one weight with its head); the
    middle stages hold none; chained, the stages compute the model."""
    ref = tied_model(name)
    stages = [split_stages(tied_model(name), rank, 4) for rank in range(4)]
    outside = [sorted(n for n, _ in s.named_parameters() if ".layers." not in n) for s in stages]
    assert outside == [
        ["model.embed_tokens.weight"],
        [],
        [],
        ["model.embed_tokens.weight", "model.norm.weight"],
    ]
    last = stages[-1].model
    assert last.lm_head.weight is last.model.embed_tokens.weight
    assert [s.tied_weight is not None for s in stages] == [True, False, False, True]
    assert [s.copies_tied_weight for s in stages] == [False, False, False, True]
    untied = split_stages(build_causal_lm(name, build_char_tokenizer(), seed=0), 3, 4)
    assert not untied.tied and untied.tied_weight is None
    ids_BL, mask_BL = ragged_batch()
    with torch.no_grad():
        want = ref(input_ids=ids_BL, attention_mask=mask_BL).logits
        got = ids_BL
        for stage in stages:
            got = stage.forward(got, mask_BL)
    assert (got - want).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="tied embedding but got no tied_group"):
        PipelineRunner(stages[0], None, 0, 4)


@pytest.mark.parametrize("kind", ["untied", "tied", "value"])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_the_planners_parameter_count_is_the_busiest_stages(kind, pp):
    """What plan validation and the cost model count per stage (``pipeline_params(pp) / pp``) against the
    parameters each stage holds once split: the busiest, within the norm vectors the count spreads evenly. A whole
    value model is counted as a causal LM (its untied config's output head too: the documented over-estimate)."""
    build = {
        "untied": lambda: build_causal_lm("llama-1m", build_char_tokenizer(), seed=0),
        "tied": tied_model,
        "value": value_model,
    }[kind]
    config = build().config
    held = [sum(p.numel() for p in split_stages(build(), rank, pp).parameters()) for rank in range(pp)]
    counted = ModelShape.from_config(config).pipeline_params(pp) / pp
    over = config.vocab_size * config.hidden_size if kind == "value" and pp == 1 else 0
    assert abs(counted - over - max(held)) <= 2 * config.hidden_size, (counted, held)


@pytest.mark.parametrize("name", ["llama-1m", "qwen2-1m"])
def test_stages_chained_in_one_process_equal_the_model(name):
    tok = build_char_tokenizer()
    ref = build_causal_lm(name, tok, seed=0)
    first, last = (split_stages(build_causal_lm(name, tok, seed=0), rank, 2) for rank in range(2))
    ids_BL, mask_BL = ragged_batch()
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
    return {
        "logits": _logits_diffs(rank, group),
        "logp": _logp_diff(rank, group),
        "values": _values_diff(rank, group),
        "step": _adamw_step(rank, group),
        "tied_step": _adamw_step(rank, group, tied=True),
        "ops": _op_micro_batching(rank, group),
    }


def _runner(model: torch.nn.Module, rank: int, group: Any) -> PipelineRunner:
    return PipelineRunner(split_stages(model, rank, WORLD), group, rank, WORLD)


def _logits_diffs(rank: int, group: Any) -> dict:
    tok = build_char_tokenizer()
    ref = build_causal_lm("llama-1m", tok, seed=0)
    runner = _runner(build_causal_lm("llama-1m", tok, seed=0), rank, group)
    ids_BL, mask_BL = ragged_batch()
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
    ids_BL, mask_BL = ragged_batch()
    rows = micro_batch_slices(len(LENGTHS), 2)
    got = runner.forward(
        ids_BL,
        mask_BL,
        micro_batches=2,
        broadcast_result=True,
        output_fn=lambda logits, k: logp_from_logits(logits, ids_BL[rows[k]]),
    )
    with torch.no_grad():
        want = token_logprobs(ref, ids_BL, mask_BL)
    assert got.shape == want.shape
    return (got - want)[mask_BL[:, 1:].bool()].abs().max().item()


def _values_diff(rank: int, group: Any) -> float:
    return values_diff(value_model(), _runner(value_model(), rank, group))


def _adamw_step(rank: int, group: Any, tied: bool = False) -> dict:
    """One clipped AdamW step on the token-mean NLL: unsplit full batch vs two stages × two micro-batches (with
    ``tied``, of a model whose head shares its embedding, which both stages then hold)."""
    tok = build_char_tokenizer()
    ref = tied_model() if tied else build_causal_lm("llama-1m", tok, seed=0)
    model = tied_model() if tied else build_causal_lm("llama-1m", tok, seed=0)
    runner = PipelineRunner(split_stages(model, rank, WORLD), group, rank, WORLD, tied_group=group if tied else None)
    before = {name: p.detach().clone() for name, p in ref.named_parameters()}
    losses, norms = adamw_steps(ref, runner, group)
    stage = runner.stage
    stepped = dict(ref.named_parameters())
    return {
        "losses": losses,
        "norms": norms,
        "param_diff": max((p - stepped[n]).abs().max().item() for n, p in stage.named_parameters()),
        "moved": max((p - before[n]).abs().max().item() for n, p in stage.named_parameters()),
    }


# Responses of very different lengths (0, 1, 2, 8 and 7 tokens): micro-batches of 2 hold 3 and 15 loss tokens,
# of 3 hold 1, 10 and 7, and of 5 include one without any (its loss must add nothing, not 0/0).
PROMPTS = ([1, 5, 6], [1, 7], [1, 8, 9, 10], [1, 11], [1, 12, 13])
RESPONSES = ([], [5], [7, 9], [3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17])
OP_MICRO_BATCHES = (1, 2, 3, 5)
OP_WEIGHT = 0.5
"""A data-parallel rank's loss weight (its share of the step's tokens): scales gradients, not statistics."""


def _op_batch() -> Batch:
    """Rollout columns for both train ops: random advantages, returns and old values, behaviour and reference
    log-probs a little off the model's (so ratios clip somewhere and the KL is not zero)."""
    gen = torch.Generator().manual_seed(5)
    mask = response_mask(RESPONSES)
    noise = lambda scale: torch.randn(mask.shape, generator=gen) * scale * mask  # noqa: E731
    return Batch(
        list(range(len(PROMPTS))),
        {
            "prompt_ids": [list(p) for p in PROMPTS],
            "response_ids": [list(r) for r in RESPONSES],
            "mask": mask,
            "advantages": noise(1.0),
            "returns": noise(1.0),
            "values": noise(0.3),
            "logp": noise(0.3) - 3.5,
            "ref_logp": noise(0.3) - 3.5,
        },
    )


def _op_role(name: str, model: torch.nn.Module, rank: int | None, group: Any) -> Role:
    """A trainable role, staged when ``rank`` is given; its optimizer leaves the weights (and gradients) be."""
    pipeline = None if rank is None else _runner(model, rank, group)
    model = model if pipeline is None else pipeline.stage.model
    return Role(
        name,
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        grad_clip=1e9,
        passes=ModelPasses(model, pipeline=pipeline),
    )


def _op_context(role: Role, micro_batches: int, rows: int) -> OpContext:
    tok = build_char_tokenizer()
    return OpContext(
        role,
        0,
        0,
        tok.pad_token_id,
        tok.eos_token_id,
        str,
        train_steps=((tuple(range(rows)), OP_WEIGHT),),
        micro_batches=micro_batches,
    )


OP_ALGO = AlgoConfig(entropy_coef=0.01, kl_coef=0.1)


def _loss_fn(ctx: OpContext) -> Callable:
    """The workflow's loss of the context's role: PPO's critic loss, or the actor's with entropy and KL terms."""
    if ctx.role.name == "critic":
        return partial(_critic_loss, ctx, algo=OP_ALGO)
    return partial(_actor_loss, ctx, algo=OP_ALGO, old_key="logp", kl_in_loss=True)


def _train(role: Role, micro_batches: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """One optimizer step of ``train_loop`` over the whole op batch: its statistics and the gradients."""
    batch = _op_batch()
    ctx = _op_context(role, micro_batches, len(batch))
    stats = train_loop(ctx, batch, _loss_fn(ctx), 0.9)["stats"]
    return stats, {n: p.grad.detach().clone() for n, p in role.model.named_parameters() if p.grad is not None}


def _diffs(got: tuple[dict, dict], want: tuple[dict, dict]) -> dict:
    """Largest relative differences of the statistics got and of the gradients got (a stage's part)."""
    (stats, grads), (want_stats, want_grads) = got, want
    scale = max(g.abs().max().item() for g in want_grads.values())
    return {
        "stats": {k: abs(v - want_stats[k]) / max(abs(want_stats[k]), 1e-6) for k, v in stats.items()},
        "grads": max((g - want_grads[n]).abs().max().item() for n, g in grads.items()) / scale,
        "grad_names": sorted(grads),
    }


def _op_micro_batching(rank: int, group: Any) -> dict:
    """Train and inference ops on a staged role with 1, 2, 3 and 5 micro-batches, and on the unsplit role with
    3 (gradient accumulation), against the unsplit role with one; plus how far a row-weighted average of the
    micro-batch losses would be off (to show the token weighting is exercised)."""
    tok = build_char_tokenizer()
    out: dict[str, Any] = {}
    for name, build in (("actor", lambda: build_causal_lm("llama-1m", tok, seed=0)), ("critic", value_model)):
        want = _train(_op_role(name, build(), None, group), 1)
        out[name] = {m: _diffs(_train(_op_role(name, build(), rank, group), m), want) for m in OP_MICRO_BATCHES}
        out[name]["unstaged3"] = _diffs(_train(_op_role(name, build(), None, group), 3), want)
        out[name]["want_stats"] = sorted(want[0])
    batch, ref = _op_batch(), _op_role("actor", build_causal_lm("llama-1m", tok, seed=0), None, group)
    ctx = _op_context(ref, 1, len(batch))
    want = logprob_op(ctx, batch, "x", 0.9)["x"]
    staged = _op_role("actor", build_causal_lm("llama-1m", tok, seed=0), rank, group)
    out["logprob"] = {
        m: (logprob_op(_op_context(staged, m, 5), batch, "x", 0.9)["x"] - want)[batch["mask"] > 0].abs().max().item()
        for m in (2, 3, 8)
    }  # 8 > rows: clipped to one row each
    critic_want = values_op(_op_context(_op_role("critic", value_model(), None, group), 1, 5), batch)["values"]
    critic = _op_role("critic", value_model(), rank, group)
    out["values"] = {
        m: (values_op(_op_context(critic, m, 5), batch)["values"] - critic_want)[batch["mask"] > 0].abs().max().item()
        for m in (2, 3)
    }
    out["naive_gap"] = _row_weighted_gap()
    return out


def _row_weighted_gap() -> float:
    """|row-weighted mean of the 2 micro-batches' token-mean policy losses − the batch's token-mean| / |the
    latter|: what weighting micro-batches by rows instead of loss tokens would get wrong on this batch."""
    model, batch = build_causal_lm("llama-1m", build_char_tokenizer(), seed=0), _op_batch()
    ctx = _op_context(Role("actor", model), 1, len(batch))
    loss_fn = _loss_fn(ctx)

    def loss_of(rows: range) -> float:
        part = batch.select(rows)
        ids_BL, attn_BL, plen_B = pack_sequences(part["prompt_ids"], part["response_ids"], ctx.pad_id, ctx.role.device)
        with torch.no_grad():
            out_BR2 = response_outputs(model, ids_BL, attn_BL, plen_B, response_width(attn_BL, plen_B), 0.9)
            return float(loss_fn(part, out_BR2, (ids_BL, attn_BL, plen_B))[0])

    parts = micro_batch_slices(len(batch), 2)
    rows = [range(s.start, s.stop) for s in parts]
    naive = sum(len(r) * loss_of(r) for r in rows) / len(batch)
    whole = loss_of(range(len(batch)))
    return abs(naive - whole) / abs(whole)


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


@pytest.mark.parametrize("step", ["step", "tied_step"], ids=["untied", "tied"])
def test_pp_adamw_step_with_clipping_equals_single_process(ranks, step):
    """With tied embeddings each end stage's copy takes the whole model's step: the two stages' gradients
    summed, the matrix counted once in the clipping norm."""
    for result in ranks:
        ref_loss, pp_loss = result[step]["losses"]
        ref_norm, pp_norm = result[step]["norms"]
        assert abs(pp_loss - ref_loss) < 1e-5 * abs(ref_loss)
        assert ref_norm > MAX_NORM * 5, "the step must actually clip"
        assert abs(pp_norm - ref_norm) < 1e-5 * ref_norm
        assert result[step]["moved"] > 1e-4
        assert result[step]["param_diff"] < 1e-5


def test_ops_with_micro_batches_on_a_staged_role_equal_one_micro_batch_unsplit(ranks):
    """Train ops: every micro-batch count gives the one-micro-batch gradients (each stage its part) and, on the
    last stage, the same token-mean statistics; so does gradient accumulation on the unsplit role."""
    assert ranks[0]["ops"]["naive_gap"] > 0.05, "the batch must make row weighting differ from token weighting"
    for rank, result in enumerate(ranks):
        for name in ("actor", "critic"):
            ops = result["ops"][name]
            for m in (*OP_MICRO_BATCHES, "unstaged3"):
                diffs = ops[m]
                assert diffs["grads"] < 1e-5, (rank, name, m, diffs["grads"])
                assert diffs["grad_names"], (rank, name, m)
                assert all(d < 1e-5 for d in diffs["stats"].values()), (rank, name, m, diffs["stats"])
                if rank == 1 or m == "unstaged3":  # the last stage publishes the loss statistics
                    assert sorted(diffs["stats"]) == ops["want_stats"], (rank, name, m)
                else:
                    assert sorted(diffs["stats"]) == [f"{name}/grad_norm", f"{name}/lr"], (rank, name, m)


def test_inference_ops_with_micro_batches_on_a_staged_role_equal_unsplit(ranks):
    """Each micro-batch's log-probs are of its own rows' tokens; more micro-batches than rows is clipped."""
    for result in ranks:
        assert all(d < 1e-5 for d in result["ops"]["logprob"].values()), result["ops"]["logprob"]
        assert all(d < 1e-5 for d in result["ops"]["values"].values()), result["ops"]["values"]


# ------------------------------------------------------------- single process: what the ops ask the pipeline
class _SpyPipeline:
    """A one-stage pipeline (pp=1, nothing communicated) that records the micro-batches each call asks for."""

    def __init__(self, model: torch.nn.Module):
        self.runner = PipelineRunner(split_stages(model, 0, 1), None, 0, 1)
        self.stage, self.group = self.runner.stage, None
        self.asked: list[int] = []

    def forward(self, ids_BL, attn_BL, micro_batches: int = 1, **kwargs):
        self.asked.append(micro_batches)
        return self.runner.forward(ids_BL, attn_BL, micro_batches, **kwargs)

    def train_step_backward(self, ids_BL, attn_BL, loss_fn, micro_batches: int = 1, **kwargs):
        self.asked.append(micro_batches)
        return self.runner.train_step_backward(ids_BL, attn_BL, loss_fn, micro_batches, **kwargs)

    def sum_tied_gradient(self) -> None:
        self.runner.sum_tied_gradient()


@pytest.mark.parametrize("micro_batches,runs", [(1, 1), (3, 3), (8, 5)], ids=["one", "three", "clipped_to_rows"])
def test_ops_run_the_contexts_micro_batches_through_the_pipeline(micro_batches, runs):
    """Inference and training ask the pipeline for ``ctx.micro_batches`` (at most one per row: 5 here)."""
    batch = _op_batch()
    actor = _SpyPipeline(build_causal_lm("llama-1m", build_char_tokenizer(), seed=0))
    role = Role(
        "actor",
        actor.stage.model,
        torch.optim.SGD(actor.stage.parameters(), lr=0.0),
        passes=ModelPasses(actor.stage.model, pipeline=actor),
    )
    ctx = _op_context(role, micro_batches, len(batch))
    logprob_op(ctx, batch, "x", 1.0)
    train_loop(ctx, batch, _loss_fn(ctx), 0.9)
    critic = _SpyPipeline(value_model())
    values_op(
        _op_context(
            Role("critic", critic.stage.model, passes=ModelPasses(critic.stage.model, pipeline=critic)),
            micro_batches,
            len(batch),
        ),
        batch,
    )
    assert actor.asked == [runs, runs] and critic.asked == [runs]


class _WidthSpy(torch.nn.Module):
    """A model that records the width of every input it is given."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model, self.widths = model, []
        self.config = model.config

    def forward(self, input_ids, **kwargs):
        self.widths.append(input_ids.shape[1])
        return self.model(input_ids=input_ids, **kwargs)


def test_inference_micro_batches_run_sorted_by_length_each_cut_to_its_longest_row():
    """Several micro-batches: rows of similar length together, none computed past its longest row; the outputs
    are those of one micro-batch over the whole padded batch, in the batch's order."""
    batch = _op_batch()
    model = build_causal_lm("llama-1m", build_char_tokenizer(), seed=0)
    lengths = sorted(len(p) + len(r) for p, r in zip(batch["prompt_ids"], batch["response_ids"]))
    whole = logprob_op(_op_context(Role("actor", model, passes=ModelPasses(model)), 1, len(batch)), batch, "x", 1.0)
    spy = _WidthSpy(model)
    split = logprob_op(_op_context(Role("actor", spy, passes=ModelPasses(spy)), 3, len(batch)), batch, "x", 1.0)
    mask = response_mask(batch["response_ids"], split["x"].shape[1]).bool()  # past a row's end: not computed
    assert torch.allclose(split["x"][mask], whole["x"][mask], atol=1e-6)
    parts = padded_micro_batch_slices(lengths, 3)  # cut where they pad least
    assert spy.widths == [lengths[rows][-1] for rows in parts] and spy.widths[0] < max(lengths)
    assert _padded(lengths, parts) <= _padded(lengths, micro_batch_slices(len(batch), 3))
    critic = value_model()
    ctx = lambda m: _op_context(Role("critic", critic, passes=ModelPasses(critic)), m, len(batch))  # noqa: E731
    assert torch.allclose(values_op(ctx(3), batch)["values"][mask], values_op(ctx(1), batch)["values"][mask], atol=1e-6)


# ------------------------------------------------------------------------------------------ 1F1B on 4 stages
def _four_stage_step(rank: int) -> dict:
    """One clipped AdamW step of llama-1m (4 layers) split into 4 stages, with 4 micro-batches: 1F1B's warm-up
    runs 3, 2, 1 and 0 forwards on stages 0..3 before its first backward. Then the same with tied embeddings,
    over the groups the runtime makes (the first and the last stage summing the shared matrix's gradient)."""
    tok = build_char_tokenizer()
    ref = build_causal_lm("llama-1m", tok, seed=0)
    runner = PipelineRunner(split_stages(build_causal_lm("llama-1m", tok, seed=0), rank, 4), dist.group.WORLD, rank, 4)
    losses, norms = adamw_steps(ref, runner, dist.group.WORLD, micro_batches=4)
    stepped = dict(ref.named_parameters())
    out = {
        "losses": losses,
        "norms": norms,
        "peak_in_flight": runner.peak_in_flight,
        "param_diff": max((p - stepped[n]).abs().max().item() for n, p in runner.stage.named_parameters()),
    }
    alloc = Allocation.parse("0-3:pp4")
    groups = AllocationGroups(rank, [alloc], device_type="cpu")[alloc]
    ref = tied_model()
    stage = split_stages(tied_model(), groups.pp_rank, 4)
    runner = PipelineRunner(stage, groups.pp_group, groups.pp_rank, 4, groups.stage_ranks, groups.tied_group)
    losses, norms = adamw_steps(ref, runner, groups.pp_group, micro_batches=4)
    stepped = dict(ref.named_parameters())
    out["tied"] = {
        "losses": losses,
        "norms": norms,
        "tied_group": dist.get_process_group_ranks(groups.tied_group) if groups.tied_group is not None else None,
        "param_diff": max((p - stepped[n]).abs().max().item() for n, p in stage.named_parameters()),
    }
    return out


def test_1f1b_on_four_stages_equals_single_process_and_bounds_kept_micro_batches():
    results = run_world(_four_stage_step, 4, timeout_s=TIMEOUT_S)
    for rank, result in enumerate(results):
        for run in (result, result["tied"]):
            (ref_loss, pp_loss), (ref_norm, pp_norm) = run["losses"], run["norms"]
            assert abs(pp_loss - ref_loss) < 1e-5 * abs(ref_loss), rank
            assert abs(pp_norm - ref_norm) < 1e-5 * ref_norm, rank
            assert run["param_diff"] < 1e-5, rank
        assert result["tied"]["tied_group"] == ([0, 3] if rank in (0, 3) else None), rank
        # stage r keeps at most P - r micro-batches' activations (GPipe would keep all 4 on every stage)
        assert result["peak_in_flight"] == 4 - rank, (rank, result["peak_in_flight"])
