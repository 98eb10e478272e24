"""A first, deliberately simple memory estimate of a model's shard, used to reject plans that cannot fit.

For a model with ``P`` parameters sharded ``tp`` × ``pp`` ways (data parallelism replicates them), one device
holds

- weights: ``P / (tp·pp) · bytes_per_param``;
- for a trained copy, additionally gradients, always in fp32 (``P / (tp·pp) · 4``: a 16-bit weight's gradients
  are summed in an fp32 ``main_grad``, :mod:`loomrl.parallel.main_grad`), and the optimizer's fp32 state
  (:func:`optimizer_bytes_per_param`: two Adam moments, plus an fp32 master copy of the weights when they are
  held in a 16-bit type), divided by ``dp`` too when the train allocation shards it (ZeRO-1, ``zero``);
- under FSDP (``fsdp``) the fp32 weights, gradients and optimizer state all divided by ``dp``.

Activations, the KV cache and framework buffers are left out: the plan validator asks only whether the
resident state fits, and the planner's memory model (a later issue) adds the rest. ``P`` is counted from
the HF config fields every zoo architecture has (:func:`loomrl.plan.model_shape.param_count`); value and reward models
are counted as causal LMs, an overestimate of ``vocab_size · hidden_size`` parameters (their score head is
``hidden_size × 1``). Under pipeline parallelism the callers pass ``P`` for the busiest stage
(:meth:`~loomrl.plan.model_shape.ModelShape.pipeline_params`: a vocabulary table on each end stage), which is
exact for value models and for a tied model's second copy of its embedding.
"""

from __future__ import annotations

__all__ = [
    "ADAM_BYTES_PER_PARAM",
    "GRAD_BYTES_PER_PARAM",
    "MASTER_BYTES_PER_PARAM",
    "optimizer_bytes_per_param",
    "shard_bytes",
]

ADAM_BYTES_PER_PARAM = 8
"""Two fp32 moments (exp_avg, exp_avg_sq) per trained parameter."""
MASTER_BYTES_PER_PARAM = 4
"""The fp32 master copy of a weight trained in 16-bit mixed precision."""
GRAD_BYTES_PER_PARAM = 4
"""A trained parameter's gradient, fp32 whatever the weights' type (bf16 training: 2 + 4 + 12 = 18 bytes per
parameter, Megatron-LM's figure for bf16 with fp32 gradient accumulation)."""


def optimizer_bytes_per_param(bytes_per_param: int) -> int:
    """Optimizer state per trained parameter: the two fp32 Adam moments, plus an fp32 master copy of the weight
    when the weights are held in fewer than 4 bytes (bf16/fp16 mixed precision updates the fp32 copy and casts
    it back; ZeRO's accounting, Rajbhandari et al. 2020 §3.1: K = 12 bytes of optimizer state per parameter).
    Weights trained in fp32, as the CPU runtime does, are their own master copy: 8 bytes."""
    return ADAM_BYTES_PER_PARAM + (MASTER_BYTES_PER_PARAM if bytes_per_param < 4 else 0)


def shard_bytes(
    params: int,
    tp: int,
    pp: int,
    bytes_per_param: int,
    trained: bool,
    optimizer_shards: int = 1,
    param_shards: int = 1,
    optimizer_on_host: bool = False,
    trained_params: int | None = None,
) -> int:
    """Bytes of one device's shard: weights, plus gradients and optimizer state when ``trained``; the optimizer
    state divided over ``optimizer_shards`` data-parallel ranks under ZeRO-1 (the allocation's ``zero``).

    ``param_shards > 1`` (FSDP over that many ranks, trained only) divides everything: FSDP keeps the sharded
    weights in fp32 whatever the compute type (the 16-bit copy is gathered one layer at a time, transient
    memory of the call), so they are their own master copy: ``16 / param_shards`` bytes per parameter.
    ``optimizer_on_host``: Adam's moments and the fp32 master weights live in host memory (optimizer offload),
    so a device holds the weights and their gradients only; under FSDP, its 16-bit weight shard alone.
    ``trained_params``: the parameters with gradients and optimizer state when fewer than ``params`` train (a LoRA
    model's adapters, in fp32, over a frozen base in ``bytes_per_param``)."""
    optimizer = 0 if optimizer_on_host else optimizer_bytes_per_param(bytes_per_param)
    if trained and trained_params is not None and trained_params < params:
        frozen = shard_bytes(params - trained_params, tp, pp, 4 if param_shards > 1 else bytes_per_param, False)
        split = tp * pp * param_shards
        adapters = -(-trained_params * (4 + GRAD_BYTES_PER_PARAM) // split)  # fp32: their own master copy
        adam = 0 if optimizer_on_host else -(-trained_params * ADAM_BYTES_PER_PARAM // (split * optimizer_shards))
        return -(-frozen // param_shards) + adapters + adam
    if trained and param_shards > 1:
        # the fp32 shards are the master copy. With the optimizer on the host the device keeps its 16-bit weight
        # shard only: DeepSpeed ZeRO-3 allocates the gradient partitions on the optimizer's device, the CPU when
        # the optimizer is offloaded (deepspeed/runtime/zero/stage3.py, grad_partitions_flat_buffer on
        # self.device); a layer's unsharded gradients before their reduce-scatter are the call's transient memory
        per_param = bytes_per_param if optimizer_on_host else 4 + GRAD_BYTES_PER_PARAM + ADAM_BYTES_PER_PARAM
        return -(-params * per_param // (tp * pp * param_shards))
    state = -(-params * bytes_per_param // (tp * pp))  # ceil: a shard never rounds down to fit
    if not trained:
        return state
    grads = -(-params * GRAD_BYTES_PER_PARAM // (tp * pp))
    return state + grads + -(-params * optimizer // (tp * pp * optimizer_shards))
