"""The analytic terms of the cost model, one small pure function each: FLOPs, bytes, communication volumes.

Nothing here knows about allocations or MFCs; :mod:`loomrl.planner.cost.model` assembles these terms per call.
Units: FLOPs, bytes, seconds, bytes/s. ``b`` is bytes per element of weights and activations (2 for bf16).

Sources of the formulas (restated, not copied): the 2·P FLOPs per token of a forward pass and 3× that for
forward + backward (Kaplan et al. 2020, "Scaling Laws", §2.1); the per-layer activation bytes of a
tensor-parallel transformer (Korthikanti et al. 2022, "Reducing Activation Recomputation", §4.1, without
sequence parallelism, attention scores not stored as with fused attention); ring all-reduce moving
2(n−1)/n of the buffer through each device (Patarasuk & Yuan 2009).
"""

from __future__ import annotations

import math

from loomrl.plan.model_shape import ModelShape

__all__ = [
    "OPS_PER_LAYER",
    "adam_step_bytes",
    "forward_ops",
    "optimizer_ops",
    "attention_flops",
    "decode_weight_bytes",
    "decode_step_slots",
    "forward_flops",
    "inference_activation_bytes",
    "recompute_activation_bytes",
    "kv_bytes_per_token",
    "mlp_width",
    "pipeline_slots",
    "ring_allreduce_bytes",
    "ring_allreduce_time",
    "roofline",
    "sum_linear",
    "sum_max_linear",
    "train_activation_bytes",
    "train_flops",
    "transfer_time",
]

FP32 = 4
"""Bytes of the fp32 values the cost model assumes regardless of the weights' dtype: Adam moments, logits."""


OPS_PER_LAYER = 24
"""Operators one decoder layer dispatches in a forward pass: two norms, four attention projections, rotary
embedding, scores, softmax, weighted sum, three MLP projections, the activation and its product, two residual
adds, plus the reshapes between them. On a GPU each is a kernel launch; on a CPU each is an eager dispatch."""
OPS_OUTSIDE_LAYERS = 8
"""Operators of a forward pass outside the layers: the embedding, final norm, head and the log-prob gather."""
SAMPLE_OPS = 16
"""Operators of one decode step outside the model: temperature, top-k/top-p filtering, the random draw, the
stop test and the slot bookkeeping (:mod:`loomrl.rollout.sampling`)."""
OPS_PER_TENSOR_STEP = 14
"""Operators per parameter tensor of one optimizer step: Adam's moment updates, bias correction and the
update (≈ 10, per tensor unless fused), the gradient-norm clip (2) and zeroing the gradient (2)."""


def forward_ops(shape: ModelShape, layers: float) -> float:
    """Operators one forward pass over ``layers`` decoder layers dispatches (one pipeline stage's share);
    the head's operators count once, on the stage that has it, so a stage's share is ``layers/pp``."""
    return layers * OPS_PER_LAYER + OPS_OUTSIDE_LAYERS * layers / shape.layers


def optimizer_ops(shape: ModelShape, layers: float) -> float:
    """Operators of one optimizer step over ``layers`` layers' parameter tensors (9 per Llama layer) and the
    embedding, final norm and head, shared out like :func:`forward_ops`."""
    return OPS_PER_TENSOR_STEP * (9 * layers + 3 * layers / shape.layers)


def attention_flops(shape: ModelShape, sum_sq_len: float) -> float:
    """Causal self-attention FLOPs of a forward pass over sequences whose squared lengths sum to ``sum_sq_len``.

    Per layer and sequence of length S, QKᵀ and AV each multiply S²/2 (query, key) pairs over the query width
    (``heads · head_dim``, the hidden size in most models) at 2 FLOPs a multiply-add: 2·width·S² in all.
    """
    return 2.0 * shape.layers * shape.q_dim * sum_sq_len


def forward_flops(shape: ModelShape, tokens: float, sum_sq_len: float) -> float:
    """FLOPs of one forward pass over ``tokens`` tokens: 2 per matmul parameter per token, plus attention."""
    return 2.0 * shape.matmul_params * tokens + attention_flops(shape, sum_sq_len)


def train_flops(shape: ModelShape, tokens: float, sum_sq_len: float) -> float:
    """Forward + backward FLOPs: the backward pass costs twice the forward (gradients of inputs and weights).
    No activation recomputation (it would add one more forward)."""
    return 3.0 * forward_flops(shape, tokens, sum_sq_len)


def decode_weight_bytes(shape: ModelShape, tokens: float, b: float) -> float:
    """Weight bytes a decode step over ``tokens`` tokens reads: all of a dense model's; of a mixture of experts,
    everything but the experts, and of each layer's experts those some token is routed to, ``E·(1 − (1 −
    k/E)^tokens)`` of E with k per token (uniform routing): a few tokens touch few experts, hundreds all."""
    if not shape.moe:
        return shape.params * b
    touched = shape.experts * (1.0 - (1.0 - shape.active_experts / shape.experts) ** max(tokens, 1.0))
    per_expert = shape.expert_params / shape.experts
    return (shape.params - shape.expert_params + per_expert * touched) * b


def kv_bytes_per_token(shape: ModelShape, b: float) -> float:
    """KV-cache bytes of one cached token over all layers: a key and a value of ``kv_dim`` each."""
    return 2.0 * shape.layers * shape.kv_dim * b


def fsdp_round_ops(shape: ModelShape) -> float:
    """Operators FSDP dispatches per micro-batch for its three collectives (forward all-gather, backward
    all-gather, gradient reduce-scatter) over all units: each unit (a decoder layer; the root with the
    embedding, final norm and head) copies its shards into one buffer, runs the collective and copies out,
    and handles each of its parameters once (FSDP2 swaps every parameter between its sharded and unsharded
    tensors)."""
    names = shape.param_shapes(layers=1)
    per_layer = sum(".layers." in n for n in names)
    root = len(names) - per_layer
    return 3 * (shape.layers * (3 + per_layer) + 3 + root)


def adam_step_bytes(params: float, b: float) -> float:
    """Memory traffic of one Adam step over ``params`` parameters: read the weights, gradients and both fp32
    moments, write weights and moments back. Weights of fewer than 4 bytes are updated through their fp32 master
    copy (read and written) from fp32 gradients and then cast: the ``b``-byte weights are only written."""
    if b < FP32:
        return params * (b + 7 * FP32)
    return params * (3 * b + 4 * FP32)


def roofline(flops: float, nbytes: float, flops_rate: float, mem_bandwidth: float) -> float:
    """Seconds of a kernel bound by whichever is slower: its arithmetic or its memory traffic."""
    return max(flops / flops_rate, nbytes / mem_bandwidth)


def ring_allreduce_bytes(nbytes: float, n: int) -> float:
    """Bytes each of ``n`` devices sends in a ring all-reduce of an ``nbytes`` buffer (reduce-scatter then
    all-gather, each moving (n−1)/n of the buffer)."""
    return 0.0 if n <= 1 else 2.0 * (n - 1) / n * nbytes


def ring_allreduce_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Seconds of an all-reduce: the ring's volume over the link, plus ``latency`` per level of a binary
    tree over the n devices (⌈log2 n⌉), the depth of the tree algorithms collective libraries switch to for
    the small, latency-bound messages of decode."""
    if n <= 1:
        return 0.0
    return ring_allreduce_bytes(nbytes, n) / bandwidth + math.ceil(math.log2(n)) * latency


def ring_allgather_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Seconds of an all-gather of ``nbytes`` in all (each of the n devices contributes 1/n): the ring sends
    (n − 1)/n of it over each link, in n − 1 steps."""
    if n <= 1:
        return 0.0
    return nbytes * (n - 1) / n / bandwidth + (n - 1) * latency


def transfer_time(nbytes: float, bandwidth: float, latency: float) -> float:
    """Seconds of one point-to-point message."""
    return nbytes / bandwidth + latency if nbytes > 0 else 0.0


def pipeline_slots(pp: int, micro_batches: int) -> int:
    """Pipeline time slots of one pass (GPipe and 1F1B alike): ``micro_batches`` slots of work on the slowest stage
    plus ``pp − 1``
    slots of fill/drain, i.e. a bubble of (pp−1)/(micro_batches+pp−1) of the pass."""
    return micro_batches + pp - 1


def decode_step_slots(pp: int, micro_batches: int) -> int:
    """Stage slots per decode step in a pipeline's steady state: a micro-batch's next token enters stage 0
    as soon as it leaves the last stage, so the pipeline fills once per generation, not once per token; a
    step takes ``micro_batches`` slots, or ``pp`` when there are too few micro-batches to keep every stage
    busy."""
    return max(pp, micro_batches)


def train_activation_bytes(
    shape: ModelShape, tokens: float, layers: float, tp: int, b: float, logit_tokens: float | None = None
) -> float:
    """Activation bytes a training pass keeps for its backward over ``tokens`` tokens and ``layers`` layers.

    Per layer and token hidden·(10 + 24/tp) bytes at 2-byte activations (scaled by b/2): the tp-split parts
    (projections' inputs and outputs, MLP activations) and the replicated ones (norms' inputs, dropout-free
    residuals). The fp32 logits over the vocabulary shard and their gradient come on top, for ``logit_tokens``
    tokens (all of them unless a chunked cross-entropy holds fewer at once).
    """
    per_token_layer = shape.hidden * (10 + 24 / tp) * b / 2
    logits = 2 * (tokens if logit_tokens is None else logit_tokens) * shape.vocab / tp * FP32
    return tokens * layers * per_token_layer + logits


def recompute_activation_bytes(
    shape: ModelShape,
    tokens: float,
    layer_tokens: float,
    layers: float,
    tp: int,
    b: float,
    logit_tokens: float | None = None,
) -> float:
    """Activation bytes a training pass with activation checkpointing keeps: each layer's input for the
    ``tokens`` tokens in flight (hidden·b per token, replicated over tp), plus one layer's full activations
    (:func:`train_activation_bytes`) for the ``layer_tokens`` of the micro-batch being recomputed, with its
    logits."""
    return tokens * layers * shape.hidden * b + train_activation_bytes(shape, layer_tokens, 1, tp, b, logit_tokens)


def inference_activation_bytes(
    shape: ModelShape, tokens: float, tp: int, b: float, logit_tokens: float | None = None
) -> float:
    """Working set of a forward pass without gradients over ``tokens`` tokens: one layer's buffers (residual,
    normalised input, attention output, the MLP's gated intermediate shard) and the fp32 logits shard of
    ``logit_tokens`` tokens (all of them by default)."""
    per_token = (4 * shape.hidden + 2 * mlp_width(shape) / tp) * b
    logits = (tokens if logit_tokens is None else logit_tokens) * shape.vocab / tp * FP32
    return tokens * per_token + logits


def mlp_width(shape: ModelShape) -> int:
    """The MLP width one token passes through: the dense MLP's, or its routed experts' and the shared ones'."""
    if shape.moe:
        return shape.active_experts * shape.expert_intermediate + shape.shared_intermediate
    return shape.intermediate


def sum_linear(a: float, b: float, t0: int, t1: int) -> float:
    """Σ_{t=t0}^{t1−1} (a + b·t)."""
    n = t1 - t0
    return n * a + b * (t0 + t1 - 1) * n / 2 if n > 0 else 0.0


def sum_max_linear(a: float, b: float, c: float, d: float, t0: int, t1: int) -> float:
    """Σ_{t=t0}^{t1−1} max(a + b·t, c + d·t), exactly: split the range where the two lines cross."""
    if t1 <= t0:
        return 0.0
    if b == d:
        return sum_linear(max(a, c), b, t0, t1)
    cross = (c - a) / (b - d)  # first line ≥ second for t ≥ cross when b > d, for t ≤ cross when b < d
    if b > d:
        split = math.ceil(min(max(cross, t0), t1))
        return sum_linear(c, d, t0, split) + sum_linear(a, b, split, t1)
    split = min(math.floor(min(max(cross, t0 - 1), t1)) + 1, t1)
    return sum_linear(a, b, t0, split) + sum_linear(c, d, split, t1)
