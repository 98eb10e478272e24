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
from loomrl.models.heads import sequence_scores, token_logprobs, token_logprobs_and_entropy, token_values
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


@torch.no_grad()
def logprob_op(ctx: OpContext, batch: Batch, out_key: str, temperature: float) -> dict:
    """Per-token log-probs of the responses under the role's (policy) model."""
    ids_BL, attn_BL, plen_B = _packed(ctx, batch)
    width = max(len(r) for r in batch["response_ids"])
    logp_BL1 = token_logprobs(ctx.role.model, ids_BL, attn_BL, temperature)
    return {out_key: response_columns(logp_BL1, plen_B, width).float().cpu()}


@torch.no_grad()
def values_op(ctx: OpContext, batch: Batch) -> dict:
    """Per-token values of the responses under the role's value model."""
    ids_BL, attn_BL, plen_B = _packed(ctx, batch)
    width = max(len(r) for r in batch["response_ids"])
    values_BL = token_values(ctx.role.model, ids_BL, attn_BL)
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
        model_B = sequence_scores(role.model, ids_BL, attn_BL).float().cpu()
        score_B += (role.model_weight if role.rule is not None else 1.0) * model_B
    return {out_key: score_B}


def train_loop(ctx: OpContext, batch: Batch, loss_fn: Callable[[Batch], tuple[torch.Tensor, dict]]) -> dict:
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
        stats: dict[str, float] = {}
        if rows:
            loss, stats = loss_fn(batch.select(list(rows)))
            (loss * weight).backward()
        if ctx.sync_grads is not None:
            for p in model.parameters():  # a rank without rows still joins the gradient sum
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
            ctx.sync_grads(model)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), role.grad_clip))
        role.optimizer.step()
        stats[f"{role.name}/grad_norm"] = grad_norm
        for key, value in stats.items():
            totals[key] = totals.get(key, 0.0) + weight * float(value)
    n = max(len(ctx.train_steps), 1)
    return {"stats": {key: value / n for key, value in totals.items()}}
