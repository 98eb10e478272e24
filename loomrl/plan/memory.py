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
the HF config fields every zoo architecture has (see :func:`param_count`); value and reward models are
counted as causal LMs, an overestimate of ``vocab_size · hidden_size`` parameters (their score head is
``hidden_size × 1``).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["ADAM_BYTES_PER_PARAM", "GRAD_BYTES_PER_PARAM", "MASTER_BYTES_PER_PARAM", "NON_GATED_MLPS", "ModelDims",
           "attention_params", "count_params", "expert_params", "model_dims", "optimizer_bytes_per_param",
           "param_count", "shard_bytes"]

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


NON_GATED_MLPS: tuple[str, ...] = ("gpt2", "opt", "gpt_neox", "gptj", "bloom", "falcon", "starcoder2")
"""``model_type`` values whose MLP is two matrices (up, down) with a plain activation; the others (Llama, Qwen,
Mistral, Mixtral, DeepSeek, ...) gate it with a third matrix."""

_ALIASES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "intermediate_size": ("intermediate_size", "ffn_dim", "n_inner"),
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
}
"""HF config field → the names architectures give it (GPT-2's ``n_embd``, OPT's ``ffn_dim``, Mixtral's
``num_local_experts``, DeepSeek's ``n_routed_experts``), read from a plain ``config.json`` as well as from a
transformers config object (which maps some of them itself)."""


class ModelDims(NamedTuple):
    """The dimensions of a decoder-only transformer that its parameter count and costs follow from."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    """Width of one attention head; ``hidden / heads`` unless the config says otherwise (Qwen3: 128)."""
    intermediate: int
    """The dense MLP's width (every layer's, or the dense layers' of a mixture-of-experts model)."""
    vocab: int
    tied: bool
    """Whether the output head is the input embedding (one ``vocab × hidden`` table, used twice)."""
    mlp_matrices: int
    """3 for a gated MLP (gate, up, down), 2 for a plain one (:data:`NON_GATED_MLPS`)."""
    experts: int = 0
    """Routed experts per mixture-of-experts layer (0: a dense model)."""
    active_experts: int = 0
    """Experts each token is routed to (top-k)."""
    expert_intermediate: int = 0
    """One expert's MLP width."""
    shared_intermediate: int = 0
    """Width of the shared experts every token also passes through (0: none)."""
    dense_layers: int = 0
    """Leading layers with a dense MLP in a mixture-of-experts model (DeepSeek's ``first_k_dense_replace``)."""

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts."""
        return self.layers - self.dense_layers if self.experts else 0


def _get(config: object, name: str) -> object:
    for alias in _ALIASES.get(name, (name,)):
        value = getattr(config, alias, None)
        if value is not None:
            return value
    return None


def _field(config: object, name: str, default: int | None = None) -> int:
    value = _get(config, name)
    if value is None:
        if default is None:
            raise AttributeError(f"the model config has no {name}")
        return default
    return int(value)


def model_dims(config: object) -> ModelDims:
    """Read an HF-config-like object (a transformers config or a ``config.json`` as attributes): hidden size,
    layers, heads, key/value heads, ``head_dim``, MLP width, vocabulary, tied embeddings, gated or plain MLP and,
    for a mixture of experts, the routed experts, how many a token uses, their width, shared experts and
    leading dense layers."""
    h = _field(config, "hidden_size")
    heads = _field(config, "num_attention_heads")
    model_type = getattr(config, "model_type", None)
    experts = _field(config, "num_experts", 0)
    expert_inter = shared = dense = active = 0
    if experts:
        active = _field(config, "num_experts_per_tok", 2)
        expert_inter = _field(config, "moe_intermediate_size", 0) or _field(config, "intermediate_size")
        shared = _field(config, "shared_expert_intermediate_size", 0) or \
            _field(config, "n_shared_experts", 0) * expert_inter
        dense = _field(config, "first_k_dense_replace", 0) or len(getattr(config, "mlp_only_layers", None) or ())
    return ModelDims(
        hidden=h, layers=_field(config, "num_hidden_layers"), heads=heads,
        kv_heads=_field(config, "num_key_value_heads", heads), head_dim=_field(config, "head_dim", 0) or h // heads,
        intermediate=_field(config, "intermediate_size", 4 * h), vocab=_field(config, "vocab_size"),
        tied=_tied(config, model_type),
        mlp_matrices=2 if model_type in NON_GATED_MLPS else 3, experts=experts, active_experts=active,
        expert_intermediate=expert_inter, shared_intermediate=shared, dense_layers=dense)


def _tied(config: object, model_type: object) -> bool:
    """The config's ``tie_word_embeddings``; where a plain ``config.json`` leaves it out, the default of its
    architecture in transformers (tied for GPT-2 and OPT, untied for the Llama family)."""
    value = getattr(config, "tie_word_embeddings", None)
    return bool(value) if value is not None else model_type in ("gpt2", "opt")


def attention_params(d: ModelDims) -> int:
    """One layer's attention projections: q and o (``hidden × heads·head_dim``), k and v (``kv_heads·head_dim``)."""
    return d.hidden * d.head_dim * 2 * (d.heads + d.kv_heads)


def expert_params(d: ModelDims) -> int:
    """One routed expert's parameters (a gated MLP of its width)."""
    return 3 * d.hidden * d.expert_intermediate


def count_params(d: ModelDims, active_only: bool = False) -> int:
    """Parameters of a model of dimensions ``d`` (:func:`param_count`); ``active_only`` counts only the experts a
    token passes through, what a token's matmuls touch."""
    mlp = d.mlp_matrices * d.hidden * d.intermediate
    moe = (d.active_experts if active_only else d.experts) * expert_params(d) + d.hidden * d.experts \
        + 3 * d.hidden * d.shared_intermediate
    per_layer = attention_params(d) + 2 * d.hidden
    tables = (1 if d.tied else 2) * d.vocab * d.hidden
    return tables + d.layers * per_layer + (d.layers - d.moe_layers) * mlp + d.moe_layers * moe + d.hidden


def param_count(config: object) -> int:
    """Parameters of a decoder-only transformer described by an HF-config-like object (:func:`model_dims`).

    Embedding and, unless tied, an output projection (``vocab · h`` each), and per layer: attention
    (:func:`attention_params`), an MLP of three ``h × I`` matrices (two for :data:`NON_GATED_MLPS`) or, in a
    mixture-of-experts layer, every routed expert, the router and the shared experts, and two norm vectors;
    plus the final norm. Biases and learned position embeddings are ignored (≪ 1%).
    """
    return count_params(model_dims(config))


def shard_bytes(params: int, tp: int, pp: int, bytes_per_param: int, trained: bool,
                optimizer_shards: int = 1, param_shards: int = 1, optimizer_on_host: bool = False) -> int:
    """Bytes of one device's shard: weights, plus gradients and optimizer state when ``trained``; the optimizer
    state divided over ``optimizer_shards`` data-parallel ranks under ZeRO-1 (the allocation's ``zero``).

    ``param_shards > 1`` (FSDP over that many ranks, trained only) divides everything: FSDP keeps the sharded
    weights in fp32 whatever the compute type (the 16-bit copy is gathered one layer at a time, transient
    memory of the call), so they are their own master copy: ``16 / param_shards`` bytes per parameter.
    ``optimizer_on_host``: Adam's moments and the fp32 master weights live in host memory (optimizer offload),
    so a device holds the weights and their gradients only; under FSDP, its 16-bit weight shard alone."""
    optimizer = 0 if optimizer_on_host else optimizer_bytes_per_param(bytes_per_param)
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
