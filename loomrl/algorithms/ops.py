"""The functions MFCs call: generation, inference and training steps on one role.

Each op is ``op(ctx, batch, ...) -> dict`` of new per-sample columns (or, for training, of scalar statistics
under ``stats``). Hyper-parameters are bound with :func:`functools.partial` by the workflow builders in
:mod:`loomrl.algorithms.workflows`. Ops see whatever rows the executor gives them: a whole batch in the
reference executor, one data-parallel shard on a worker.

Inference and training ops cut their rows into ``ctx.micro_batches`` micro-batches (at most one per row;
:func:`micro_batch_rows`), as the execution plan priced them, and run them through the role's engine
(:class:`~loomrl.algorithms.context.Passes`): whether that streams them through pipeline stages (1F1B for
training) or one after another, and how data-parallel ranks sum their gradients, is the engine's business, not
the ops'. Generation ignores micro-batches: the rollout engine decodes all live samples together.

A training step whose loss or gradient norm is NaN or inf is skipped or stops the run, as the role's
``on_nonfinite`` says (``train.on_nonfinite``); every rank of the step decides alike (:func:`_train_steps`).

Legend: B = samples, R = response tokens (right-padded), L = prompt + response (right-padded).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch

from loomrl.algorithms.context import OpContext, PartialRollout, Resumed, Role
from loomrl.algorithms.lr import set_lr
from loomrl.config.schema import judge_role
from loomrl.errors import TrainingError
from loomrl.models.heads import LOGP, last_real_index
from loomrl.models.lora import adapters_off
from loomrl.rollout import Completion, Request, RolloutEngine, SamplingParams, generation_eos_ids, stream_keys
from loomrl.rollout.vllm_engine import VLLMEngine
from loomrl.workflow.batch import (
    Batch,
    micro_batch_slices,
    pack_sequences,
    pad_columns,
    pad_right,
    padded_micro_batch_slices,
    response_mask,
    response_tokens,
)
from loomrl.workflow.minibatches import loss_weights


def generate_chunks(
    ctx: OpContext, batch: Batch, params: SamplingParams, out_prefix: str = "", backend: str = "loomrl"
) -> Iterator[tuple[list[int], dict]]:
    """Sample one response per row from the role's model (within its own ``max_new_tokens`` where the batch has
    that column, else the sampling parameters'), yielding ``(sample ids, columns)`` of finished rows:
    in chunks of ``ctx.stream.chunk`` as they finish when the call is part of a fused stage (whose
    ``after_step`` hook may migrate unfinished samples in or out), else all at once. Noise comes from each
    sample's own stream, so a sample's tokens do not depend on where or with whom it was generated. Under
    partial rollouts (``ctx.partial``) rows continue what they generated before and may pause, unfinished.
    ``backend`` 'vllm' generates with the role's vLLM engine (:func:`vllm_generate`), all rows at once."""
    model, control, partial = ctx.role.model, ctx.stream, ctx.partial
    prompts = batch["prompt_ids"] if len(batch) else []
    budgets = batch["max_new_tokens"] if "max_new_tokens" in batch else [None] * len(batch)  # per-sample budgets
    longest = control.max_prompt if control else max(len(p) for p in prompts)
    budget = max([params.max_new_tokens, control.max_budget if control else 0, *(b for b in budgets if b)])
    slots = control.slots if control else min(256, len(prompts))
    eos_ids = (ctx.eos_id, *generation_eos_ids(model))
    if backend == "vllm":
        done = vllm_generate(ctx.role, _requests(ctx, batch, prompts, budgets, budget), params, eos_ids, ctx.seed)
        if partial is not None:
            _record_partial(partial, ctx.iteration, done)
        if done:
            yield [c.sample_id for c in done], _generated_columns(done, out_prefix)
        return
    was_training = model.training
    model.eval()
    engine = RolloutEngine(model, params, eos_ids, ctx.pad_id, slots=max(1, slots), max_len=longest + budget)
    engine.submit(_requests(ctx, batch, prompts, budgets, budget))
    finished: list = []
    while engine.has_work() or (control is not None and control.in_step):
        done = engine.step()
        if partial is not None:
            _record_partial(partial, ctx.iteration, done)
        finished += done
        stop = control is not None and control.after_step(engine)
        last = stop or not (engine.has_work() or (control is not None and control.in_step))
        if finished and (last or (control is not None and len(finished) >= control.chunk)):
            yield [c.sample_id for c in finished], _generated_columns(finished, out_prefix)
            finished = []
        if stop:
            break
    model.train(was_training)


def vllm_generate(
    role: Role, requests: list[Request], params: SamplingParams, eos_ids: Sequence[int], seed: int
) -> list[Completion]:
    """``requests`` run to completion in ``role``'s vLLM engine (built on first use with room for twice the call's
    longest sample and as many slots as it has rows, and again when a later call's samples outgrow it; more rows
    than slots wait for one), after syncing the role's weights into it as the engine's next version and verifying
    them (:class:`~loomrl.rollout.vllm_engine.VLLMEngine`); results in request order."""
    max_len = max(len(r.prompt) + (r.max_new_tokens or params.max_new_tokens) for r in requests)
    engine = role.generator
    if engine is None or not engine.fits(max_len):
        versions = engine.syncs if engine is not None else 0
        if engine is not None:
            engine.close()
        positions = getattr(role.model.config, "max_position_embeddings", None) or 2 * max_len
        room = max(max_len, min(2 * max_len, positions))
        engine = role.generator = VLLMEngine(role.model, max_len=room, slots=len(requests), seed=seed)
        engine.syncs = versions
    version = engine.syncs + 1
    engine.sync(role.model, version)
    return engine.generate_with(requests, params, eos_ids, version)


def _requests(
    ctx: OpContext, batch: Batch, prompts: Sequence, budgets: Sequence[int | None], budget: int
) -> list[Request]:
    """One request per row; under partial rollouts a paused row continues its tokens (and its own iteration's
    random stream), and a row that is not due pauses after its segment (:meth:`PartialRollout.pause_at`)."""
    partial = ctx.partial
    resumed = partial.resumed if partial is not None else {}
    keys = stream_keys(ctx.seed, ctx.iteration, batch.ids).tolist()
    requests = []
    for sid, prompt, key, own in zip(batch.ids, prompts, keys, budgets):
        request = Request(sid, list(prompt), key, own)
        if partial is not None:
            before = resumed.get(sid)
            if before is not None:
                request.key = int(stream_keys(ctx.seed, before.iteration, [sid])[0])
                request.prefix, request.prefix_logps = list(before.tokens), list(before.logps)
            iteration = before.iteration if before is not None else ctx.iteration
            request.pause_at = partial.pause_at(iteration, len(request.prefix), budget)
        requests.append(request)
    return requests


def _record_partial(partial: PartialRollout, iteration: int, done: Sequence) -> None:
    """Each finished or paused row's token versions into ``partial``, and the paused rows' state."""
    for c in done:
        before = partial.resumed.get(c.sample_id)
        versions = before.versions if before is not None else ()
        versions += (partial.version,) * (len(c.tokens) - len(versions))
        partial.versions[c.sample_id] = versions
        if c.finish_reason == "paused":
            own = before.iteration if before is not None else iteration
            partial.paused[c.sample_id] = Resumed(own, tuple(c.tokens), tuple(c.logps), versions)


def _generated_columns(done: list, out_prefix: str) -> dict:
    responses = [c.tokens for c in done]
    out = {f"{out_prefix}response_ids": responses}
    if not out_prefix:
        out["logp"] = pad_right([c.logps for c in done])
        out["mask"] = response_mask(responses)
    return out


def generate_op(
    ctx: OpContext, batch: Batch, params: SamplingParams, out_prefix: str = "", backend: str = "loomrl"
) -> dict:
    """Sample one response per row from the role's model (:func:`generate_chunks`, all at once), in row order."""
    chunks = [Batch(ids, cols) for ids, cols in generate_chunks(ctx, batch, params, out_prefix, backend)]
    if not chunks:
        return {}
    whole = Batch.concat(chunks) if len(chunks) > 1 else chunks[0]
    index = {sid: i for i, sid in enumerate(whole.ids)}
    rows = whole.select([index[s] for s in batch.ids])
    return {key: rows[key] for key in rows.keys()}


def _packed(ctx: OpContext, batch: Batch, response_key: str = "response_ids"):
    device = ctx.role.device
    return pack_sequences(batch["prompt_ids"], batch[response_key], ctx.pad_id, device)


def micro_batch_rows(ctx: OpContext, lengths: Sequence[int]) -> list[slice]:
    """The contiguous row ranges an op over rows of ``lengths`` (sorted ascending) runs as: ``ctx.micro_batches``
    of them, clipped to one per row; cut where they compute the fewest padded tokens
    (:func:`~loomrl.workflow.batch.padded_micro_batch_slices`) where the engine takes any row ranges, near-equal
    where it cuts them itself (a pipeline's stages: :attr:`~loomrl.algorithms.context.Passes.any_parts`)."""
    k = max(1, min(ctx.micro_batches, len(lengths)))
    if ctx.role.passes.any_parts:
        return padded_micro_batch_slices(lengths, k)
    return micro_batch_slices(len(lengths), k)


def by_length(lengths_B: torch.Tensor, micro_batches: int) -> torch.Tensor:
    """The order an op runs rows of ``lengths_B`` tokens in: by length (stable), so that micro-batches hold rows
    of similar length; as they are with a single micro-batch."""
    return torch.argsort(lengths_B, stable=True) if micro_batches > 1 else torch.arange(lengths_B.shape[0])


OutputFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``output_fn(outputs, rows)``: what to keep of the per-position outputs of the micro-batch of ``rows`` (indices
of the call's packed rows), e.g. log-probs of those rows' tokens instead of their logits."""


def role_outputs(
    ctx: OpContext,
    ids_BL: torch.Tensor,
    attn_BL: torch.Tensor,
    output_fn: OutputFn | None = None,
    prompt_len_B: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The role's per-position outputs for all rows (with ``prompt_len_B``, those at the response columns:
    :meth:`~loomrl.algorithms.context.Passes.outputs`), each micro-batch's reduced by ``output_fn`` and the
    results concatenated in row order, on every rank of the role.

    With several micro-batches the rows run sorted by length, so each micro-batch holds rows of similar length
    and the engine computes it only up to its own longest row, and they are cut where they compute the fewest
    padded tokens (:func:`micro_batch_rows`; as verl's dynamic batching and OpenRLHF's packing avoid computing
    padding): on a batch with a long tail, the long rows no longer pad a quarter of the batch each."""
    lengths_B = attn_BL.sum(1)
    order = by_length(lengths_B, ctx.micro_batches)
    parts = micro_batch_rows(ctx, lengths_B[order].tolist())
    keep = (lambda out, k: output_fn(out, order[parts[k]].to(ids_BL.device))) if output_fn is not None else None
    if len(parts) == 1:
        return ctx.role.passes.outputs(ids_BL, attn_BL, parts, keep, prompt_len_B, temperature)
    plen_B = prompt_len_B[order.to(prompt_len_B.device)] if prompt_len_B is not None else None
    out = ctx.role.passes.outputs(
        ids_BL[order.to(ids_BL.device)], attn_BL[order.to(attn_BL.device)], parts, keep, plen_B, temperature
    )
    return out[torch.argsort(order).to(out.device)]


@torch.no_grad()
def logprob_op(ctx: OpContext, batch: Batch, out_key: str, temperature: float, base: bool = False) -> dict:
    """Per-token log-probs of the responses under the role's (policy) model; ``base``: under its base, its LoRA
    adapters off (a LoRA actor's reference, :func:`loomrl.models.lora.adapters_off`)."""
    ids_BL, attn_BL, plen_B = _packed(ctx, batch)
    width = max(len(r) for r in batch["response_ids"])
    with adapters_off(ctx.role.model) if base else nullcontext():
        logp_BR = role_outputs(ctx, ids_BL, attn_BL, lambda out_BR2, rows: out_BR2[..., LOGP], plen_B, temperature)
    return {out_key: pad_columns(logp_BR, width).float().cpu()}


@torch.no_grad()
def values_op(ctx: OpContext, batch: Batch) -> dict:
    """Per-token values of the responses under the role's value model."""
    ids_BL, attn_BL, plen_B = _packed(ctx, batch)
    width = max(len(r) for r in batch["response_ids"])
    values_BR = role_outputs(ctx, ids_BL, attn_BL, prompt_len_B=plen_B)
    return {"values": pad_columns(values_BR, width).float().cpu()}


@torch.no_grad()
def reward_op(
    ctx: OpContext,
    batch: Batch,
    response_key: str = "response_ids",
    out_key: str = "score",
    rule_key: str | None = None,
) -> dict:
    """Scalar reward per sample: the task's rule, a reward model, or their weighted sum. With ``rule_key``, also
    the rule's own scores per sample (:meth:`~loomrl.data.tasks.BatchScores.per_sample`; None without a rule), for
    the rollout metrics. The rule scores the op's rows together: a batched reward function is called once per
    call of the op (the whole batch, a data-parallel shard or a streamed chunk)."""
    role = ctx.role
    score_B = torch.zeros(len(batch))
    rule = None
    if role.rule is not None:
        texts = [ctx.decode(r) for r in batch[response_key]]
        rows = batch["row"] if "row" in batch else [{} for _ in texts]  # workflows without prompt-file rows
        rule = role.rule(batch["prompt_text"], texts, batch["answer"], rows)
        rule_B = torch.tensor(rule.total, dtype=torch.float32)
        score_B += (role.rule_weight if role.model is not None else 1.0) * rule_B
    if role.model is not None:
        ids_BL, attn_BL, _ = _packed(ctx, batch, response_key)
        values_BL = role_outputs(ctx, ids_BL, attn_BL)
        model_B = values_BL.gather(1, last_real_index(attn_BL).unsqueeze(1)).squeeze(1).float().cpu()
        score_B += (role.model_weight if role.rule is not None else 1.0) * model_B
    if rule_key is None:
        return {out_key: score_B}
    return {out_key: score_B, rule_key: rule.per_sample() if rule is not None else [None] * len(batch)}


@torch.no_grad()
def judge_op(
    ctx: OpContext, batch: Batch, template: str, max_new_tokens: int, out_key: str, backend: str = "loomrl"
) -> dict:
    """A judge's verdict on each sample, written greedily (on ``backend``'s engine, as the rollouts are): the
    judge's prompt made from the sample's prompt, response and answer by ``template``
    (:func:`loomrl.data.judges.judge_prompt`), its verdict's token ids in ``out_key``."""
    from loomrl.data.judges import judge_prompt

    if ctx.encode is None:
        raise RuntimeError("a judge call needs the executor's tokenizer (OpContext.encode)")
    texts = [
        judge_prompt(template, p, ctx.decode(r), a)
        for p, r, a in zip(batch["prompt_text"], batch["response_ids"], batch["answer"])
    ]
    prompts = Batch(batch.ids, {"prompt_ids": [ctx.encode(t) for t in texts]})
    out = generate_op(ctx, prompts, SamplingParams(max_new_tokens, 0.0), out_prefix="judge_", backend=backend)
    return {out_key: out["judge_response_ids"]} if out else {out_key: []}


def verdict_op(
    ctx: OpContext,
    batch: Batch,
    judges: tuple[tuple[str, str, float], ...],
    out_key: str = "score",
    rule_key: str | None = None,
) -> dict:
    """The reward from the judges' verdicts: per judge ``(verdict key, verdict reader, weight)``, the reader's
    score of each verdict (0 when unreadable), weighted and summed; with ``rule_key``, no rule scores (the
    judges replace the rule). Each judge's unreadable verdicts go to the column ``judge<i>/unreadable`` (1 per
    sample), read by the rollout metrics."""
    from loomrl.data.judges import verdict_reader

    score_B = torch.zeros(len(batch))
    out = {}
    for i, (key, spec, weight) in enumerate(judges):
        read = verdict_reader(spec)
        values = [read(ctx.decode(ids)) for ids in batch[key]]
        score_B += weight * torch.tensor([0.0 if v is None else v for v in values], dtype=torch.float32)
        out[f"{judge_role(i)}_unreadable"] = torch.tensor([float(v is None) for v in values])
    out[out_key] = score_B
    if rule_key is not None:
        out[rule_key] = [None] * len(batch)
    return out


LossFn = Callable[[Batch, torch.Tensor, tuple], tuple[torch.Tensor, dict]]
"""``loss_fn(minibatch, outputs, packed)``: the minibatch's mean loss (a token-mean, or a mean over sequences as
``ctx.loss_unit`` says) from the model's outputs at the response columns (a policy's log-probs and entropies,
B×R×2, or values_BR: :meth:`~loomrl.algorithms.context.Passes.outputs`) and the packed sequences
``(ids_BL, attn_BL, prompt_len_B)``."""


def _backward(ctx: OpContext, mb: Batch, loss_fn: LossFn, weight: float, temperature: float) -> tuple[dict, bool]:
    """Forward, loss and backward of one minibatch, micro-batch by micro-batch, through the role's engine;
    returns its statistics (empty on pipeline stages but the last) and whether every loss this rank computed
    was finite.

    Micro-batch ``k``'s loss is ``loss_fn`` of its rows alone, times its share of the minibatch's loss weight (its
    loss tokens, :func:`~loomrl.workflow.batch.response_tokens`, or its rows, as ``ctx.loss_unit`` says) and
    ``weight``: the shares sum to one, so the accumulated gradient is that of the minibatch's mean loss times
    ``weight``, whatever the micro-batching. Statistics (means) are weighted by the same shares. A micro-batch
    without loss weight adds nothing (and is not given to ``loss_fn``, whose mean would be 0/0). A rank without rows
    still tells the engine, whose passes may be collective.

    A non-finite loss is back-propagated times NaN: every gradient it reaches becomes NaN, and with it the norm
    the engine reduces over all ranks of the step (data-parallel sum, pipeline stages, shards), so every rank
    sees the fault, even where the loss itself exists on one rank only (a pipeline's last stage). A finite
    loss can have finite gradients (log of a negative number), so the loss is checked, not only the norm.
    """
    passes = ctx.role.passes
    if len(mb) == 0:
        passes.backward(None, None, [], None, ctx.micro_batches)
        return {}, True
    if ctx.micro_batches > 1 and len(mb) > 1:  # rows by length, so that micro-batches pad little (role_outputs)
        lengths_B = torch.tensor([len(p) + len(r) for p, r in zip(mb["prompt_ids"], mb["response_ids"])])
        mb = mb.select(by_length(lengths_B, ctx.micro_batches).tolist())
    ids_BL, attn_BL, plen_B = _packed(ctx, mb)
    parts = micro_batch_rows(ctx, attn_BL.sum(1).tolist())
    weights = loss_weights(response_tokens(mb), ctx.loss_unit)
    total = max(sum(weights), 1)
    shares = [sum(weights[rows]) / total for rows in parts]
    stats: dict[str, float] = {}
    finite = [True]

    def micro_loss(out: torch.Tensor, k: int) -> torch.Tensor | None:
        rows = parts[k]
        if shares[k] == 0:
            return None
        part = mb if len(parts) == 1 else mb.select(range(rows.start, rows.stop))
        loss, got = loss_fn(part, out, (ids_BL[rows], attn_BL[rows], plen_B[rows]))
        for key, value in got.items():
            stats[key] = stats.get(key, 0.0) + shares[k] * float(value)
        if not bool(torch.isfinite(loss).all()):
            finite[0] = False
            loss = loss * float("nan")
        return loss * (shares[k] * weight)

    passes.backward(ids_BL, attn_BL, parts, micro_loss, ctx.micro_batches, plen_B, temperature)
    return stats, finite[0]


def train_loop(ctx: OpContext, batch: Batch, loss_fn: LossFn, temperature: float = 1.0) -> dict:
    """The optimizer steps the executor scheduled (``ctx.train_steps``); returns weighted statistics.
    ``loss_fn`` gets the role's outputs at the response columns, a policy's log-probs at ``temperature``.

    Each step's loss is this rank's mean loss times its share of the minibatch's loss weight (tokens, or rows:
    ``ctx.loss_unit``), so once the engine has summed the ranks' gradients every rank holds the gradient of the
    whole minibatch's mean loss. Statistics are weighted the same way: summing them over the data-parallel
    ranks gives the whole batch's values. Skipped steps (a NaN or inf loss or gradient norm,
    ``role.on_nonfinite == "skip"``) add no statistics; they are counted in ``<role>/skipped_steps`` (each rank
    adds its share, so the sum over ranks is the count), present only when a step was skipped.
    """
    role = ctx.role
    model = role.model
    model.train()
    with activation_checkpointing(model, ctx.recompute):
        return _train_steps(ctx, batch, loss_fn, temperature)


@contextmanager
def activation_checkpointing(model: torch.nn.Module, on: bool):
    """Within the block, ``model``'s decoder layers keep only their inputs for the backward and recompute
    the rest (transformers' gradient checkpointing, non-reentrant: it composes with DTensor parameters and
    pipeline stages, whose layers are the same modules). Off again afterwards, so inference on the same
    weights is unaffected."""
    if not on:
        yield
        return
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        yield
    finally:
        model.gradient_checkpointing_disable()
        model.disable_input_require_grads()  # enabling added an embedding hook; do not pile one up per call


def _train_steps(ctx: OpContext, batch: Batch, loss_fn: LossFn, temperature: float) -> dict:
    role = ctx.role
    totals: dict[str, float] = {}
    skipped, skipped_share = 0, 0.0
    for k, (rows, weight) in enumerate(ctx.train_steps):
        if role.lr_at is not None:  # every iteration of a run takes the same number of steps
            set_lr(role.optimizer, role.lr_at(ctx.iteration * len(ctx.train_steps) + k))
        role.optimizer.zero_grad(set_to_none=True)
        stats, finite_loss = _backward(ctx, batch.select(list(rows)), loss_fn, weight, temperature)
        grad_norm = role.passes.reduce_and_clip(role.grad_clip)
        if not math.isfinite(grad_norm):  # the same global norm on every rank: all skip (or stop) together
            _nonfinite_step(ctx, k, finite_loss, grad_norm)
            role.optimizer.zero_grad(set_to_none=True)
            skipped, skipped_share = skipped + 1, skipped_share + weight
            continue
        role.optimizer.step()
        stats[f"{role.name}/grad_norm"] = grad_norm
        stats[f"{role.name}/lr"] = role.optimizer.param_groups[0]["lr"]
        for key, value in stats.items():
            totals[key] = totals.get(key, 0.0) + weight * float(value)
    n = max(len(ctx.train_steps) - skipped, 1)
    out = {key: value / n for key, value in totals.items()}
    if skipped:
        out[f"{role.name}/skipped_steps"] = skipped_share
    return {"stats": out}


def _nonfinite_step(ctx: OpContext, step: int, finite_loss: bool, grad_norm: float) -> None:
    """Stop the run (``on_nonfinite == "stop"``) or warn that optimizer step ``step`` is skipped."""
    role = ctx.role
    what = "gradient norm" if finite_loss else "loss (and so gradient norm)"
    where = f"{role.name}: non-finite {what} ({grad_norm}) at iteration {ctx.iteration}, optimizer step {step}"
    if role.on_nonfinite == "stop":
        raise TrainingError(f"{where}; stopping (train.on_nonfinite=stop; 'skip' would drop such steps)")
    warnings.warn(
        f"{where}; step skipped, weights and optimizer state unchanged (train.on_nonfinite=skip)",
        RuntimeWarning,
        stacklevel=3,
    )
