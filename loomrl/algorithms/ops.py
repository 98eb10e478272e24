"""The functions MFCs call: generation, inference and training steps on one role.

Each op is ``op(ctx, batch, ...) -> dict`` of new per-sample columns (or, for training, of scalar statistics
under ``stats``). Hyper-parameters are bound with :func:`functools.partial` by the workflow builders in
:mod:`loomrl.algorithms.workflows`. Ops see whatever rows the executor gives them: a whole batch in the
reference executor, one data-parallel shard on a worker.

Legend: B = samples, R = response tokens (right-padded), L = prompt + response (right-padded).
"""

from __future__ import annotations

from typing import Callable

import torch

from loomrl.algorithms.roles import OpContext
from loomrl.models.heads import last_real_index, logprobs_from_logits, model_outputs
from loomrl.parallel.pipeline_schedule import clip_grad_norm_pp
from loomrl.rollout import SamplingParams, generate, stream_keys
from loomrl.workflow.batch import Batch, pack_sequences, pad_right, response_columns, response_mask


def generate_op(ctx: OpContext, batch: Batch, params: SamplingParams, out_prefix: str = "") -> dict:
    """Sample one response per row from the role's model; noise comes from each sample's own stream."""
    model = ctx.role.model
    was_training = model.training
    model.eval()
    keys_B = stream_keys(ctx.seed, ctx.iteration, batch.ids)
    gens = generate(model, batch["prompt_ids"], keys_B, params, eos_id=ctx.eos_id, pad_id=ctx.pad_id)
    model.train(was_training)
    responses = [g.tokens for g in gens]
    out = {f"{out_prefix}response_ids": responses}
    if not out_prefix:
        out["logp"] = pad_right([g.logps for g in gens])
        out["mask"] = response_mask(responses)
    return out


def _packed(ctx: OpContext, batch: Batch, response_key: str = "response_ids"):
    device = ctx.role.device
    return pack_sequences(batch["prompt_ids"], batch[response_key], ctx.pad_id, device)


def role_outputs(ctx: OpContext, ids_BL: torch.Tensor, attn_BL: torch.Tensor,
                 output_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The role's per-position outputs (logits for a policy, values for a value model), reduced by
    ``output_fn``; a pipeline-parallel role computes them stage by stage and every stage gets the result."""
    role = ctx.role
    if role.pipeline is not None:
        fn = (lambda out, _k: output_fn(out)) if output_fn is not None else None
        return role.pipeline.forward(ids_BL, attn_BL, output_fn=fn, broadcast_result=True)
    out = model_outputs(role.model, ids_BL, attn_BL)
    return output_fn(out) if output_fn is not None else out


@torch.no_grad()
def logprob_op(ctx: OpContext, batch: Batch, out_key: str, temperature: float) -> dict:
    """Per-token log-probs of the responses under the role's (policy) model."""
    ids_BL, attn_BL, plen_B = _packed(ctx, batch)
    width = max(len(r) for r in batch["response_ids"])
    logp_BL1 = role_outputs(ctx, ids_BL, attn_BL, lambda logits: logprobs_from_logits(logits, ids_BL, temperature))
    return {out_key: response_columns(logp_BL1, plen_B, width).float().cpu()}


@torch.no_grad()
def values_op(ctx: OpContext, batch: Batch) -> dict:
    """Per-token values of the responses under the role's value model."""
    ids_BL, attn_BL, plen_B = _packed(ctx, batch)
    width = max(len(r) for r in batch["response_ids"])
    values_BL = role_outputs(ctx, ids_BL, attn_BL)
    return {"values": response_columns(values_BL, plen_B, width).float().cpu()}


@torch.no_grad()
def reward_op(ctx: OpContext, batch: Batch, response_key: str = "response_ids", out_key: str = "score") -> dict:
    """Scalar reward per sample: the task's rule, a reward model, or their weighted sum."""
    role = ctx.role
    score_B = torch.zeros(len(batch))
    if role.rule is not None:
        texts = [ctx.decode(r) for r in batch[response_key]]
        rule_B = torch.tensor([role.rule(p, t, a) for p, t, a in zip(batch["prompt_text"], texts, batch["answer"])])
        score_B += (role.rule_weight if role.model is not None else 1.0) * rule_B
    if role.model is not None:
        ids_BL, attn_BL, _ = _packed(ctx, batch, response_key)
        values_BL = role_outputs(ctx, ids_BL, attn_BL)
        model_B = values_BL.gather(1, last_real_index(attn_BL).unsqueeze(1)).squeeze(1).float().cpu()
        score_B += (role.model_weight if role.rule is not None else 1.0) * model_B
    return {out_key: score_B}


LossFn = Callable[[Batch, torch.Tensor, tuple], tuple[torch.Tensor, dict]]
"""``loss_fn(minibatch, outputs, packed)``: the minibatch's token-mean loss from the model's per-position
outputs (logits or values) and the packed sequences ``(ids_BL, attn_BL, prompt_len_B)``."""


def _backward(ctx: OpContext, mb: Batch, loss_fn: LossFn, weight: float) -> dict:
    """Forward, loss and backward of one minibatch (through the pipeline when the role is staged)."""
    role = ctx.role
    packed = _packed(ctx, mb)
    ids_BL, attn_BL, _ = packed
    if role.pipeline is None:
        loss, stats = loss_fn(mb, model_outputs(role.model, ids_BL, attn_BL), packed)
        (loss * weight).backward()
        return stats
    stats = {}

    def last_stage_loss(out: torch.Tensor, _k: int) -> torch.Tensor:
        loss, got = loss_fn(mb, out, packed)
        stats.update(got)
        return loss * weight

    role.pipeline.train_step_backward(ids_BL, attn_BL, last_stage_loss)
    return stats  # empty except on the last stage, which is the one that publishes


def _clip(role) -> float:
    if role.pipeline is not None:
        return float(clip_grad_norm_pp(role.pipeline.stage, role.grad_clip, role.pipeline.group))
    return float(torch.nn.utils.clip_grad_norm_(role.model.parameters(), role.grad_clip))


def train_loop(ctx: OpContext, batch: Batch, loss_fn: LossFn) -> dict:
    """The optimizer steps the executor scheduled (``ctx.train_steps``); returns token-weighted statistics.

    Each step's loss is this rank's token-mean loss times its token share, so after ``ctx.sync_grads`` sums the
    ranks' gradients every rank holds the gradient of the whole minibatch's token-mean loss. Statistics are
    weighted the same way: summing them over the data-parallel ranks gives the whole batch's values.
    """
    role = ctx.role
    model = role.model
    model.train()
    totals: dict[str, float] = {}
    for rows, weight in ctx.train_steps:
        role.optimizer.zero_grad(set_to_none=True)
        stats = _backward(ctx, batch.select(list(rows)), loss_fn, weight) if rows else {}
        if ctx.sync_grads is not None:
            for p in model.parameters():  # a rank without rows still joins the gradient sum
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
            ctx.sync_grads(model)
        grad_norm = _clip(role)
        role.optimizer.step()
        stats[f"{role.name}/grad_norm"] = grad_norm
        for key, value in stats.items():
            totals[key] = totals.get(key, 0.0) + weight * float(value)
    n = max(len(ctx.train_steps), 1)
    return {"stats": {key: value / n for key, value in totals.items()}}
