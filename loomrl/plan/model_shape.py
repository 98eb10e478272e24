"""The shape of a decoder-only transformer: what its parameter count, its memory and its costs follow from.

:class:`ModelShape` is the one description of a model's dimensions: plan validation counts its parameters
(:func:`param_count`), the cost model prices its passes, the reallocation coster plans transfers of its HF
parameter names and shapes (:meth:`ModelShape.param_shapes`). It is read from an HF config
(:meth:`ModelShape.from_config`: a transformers config object or a ``config.json`` read as attributes): GQA
attention with any head width (Qwen3's ``head_dim``), tied embeddings, gated or plain MLPs (OPT, GPT-2) and
mixtures of experts (routed experts, experts per token, their width, shared experts, leading dense layers).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from loomrl.errors import ConfigError

__all__ = ["NON_GATED_MLPS", "ModelShape", "param_count"]

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

_POSITIVE = ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's dimensions (module docstring)."""

    layers: int
    """Decoder layers."""
    hidden: int
    """Hidden size."""
    heads: int
    """Attention (query) heads."""
    kv_heads: int
    """Key/value heads (grouped-query attention; equal to ``heads`` without it)."""
    intermediate: int
    """The dense MLP's width (every layer's, or the dense layers' of a mixture-of-experts model)."""
    vocab: int
    """Vocabulary size."""
    params: int = 0
    """Parameters in all, every expert counted; 0 (the default) counts them from the dimensions
    (:func:`count_params`). Given by hand, it scales what follows from the count (:attr:`active_params`)."""
    head_dim: int = 0
    """Width of one attention head; 0 (the default) is ``hidden / heads``, which must then divide."""
    tied: bool = False
    """Whether the output head is the input embedding (one ``vocab × hidden`` table, used twice)."""
    mlp_matrices: int = 3
    """3 for a gated MLP (gate, up, down: Llama, Qwen), 2 for a plain one (:data:`NON_GATED_MLPS`)."""
    experts: int = 0
    """Routed experts per mixture-of-experts layer; 0 for a dense model."""
    active_experts: int = 0
    """Experts each token is routed to (top-k)."""
    expert_intermediate: int = 0
    """One expert's MLP width."""
    shared_intermediate: int = 0
    """Width of the shared experts every token also passes through (0: none)."""
    dense_layers: int = 0
    """Leading layers with a dense MLP in a mixture-of-experts model (DeepSeek's ``first_k_dense_replace``)."""
    lora_rank: int = 0
    """Rank of the LoRA adapters that train instead of the weights (0: every weight trains)."""
    lora_targets: tuple[str, ...] = ()
    """The projections with adapters (``q_proj`` ... ``down_proj``)."""

    def __post_init__(self) -> None:
        for name in _POSITIVE:
            _positive_int(name, getattr(self, name))
        if not self.head_dim and self.hidden % self.heads:
            raise ConfigError(f"model_shape.heads: {self.heads} does not divide hidden={self.hidden} (give head_dim)")
        if self.experts and not 0 < self.active_experts <= self.experts:
            raise ConfigError(
                f"model_shape.active_experts: {self.active_experts!r} is not in 1..experts={self.experts}"
            )
        if self.experts and self.expert_intermediate < 1:
            raise ConfigError(
                f"model_shape.expert_intermediate: {self.expert_intermediate!r} is not a positive integer"
            )
        if self.mlp_matrices not in (2, 3):
            raise ConfigError(f"model_shape.mlp_matrices: {self.mlp_matrices!r}; valid: 2 (plain MLP), 3 (gated)")
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if not self.params:
            object.__setattr__(self, "params", count_params(self))
        _positive_int("params", self.params)

    @classmethod
    def from_config(cls, config: object) -> ModelShape:
        """Read an HF-config-like object: hidden size, layers, heads, key/value heads, ``head_dim``, MLP width,
        vocabulary, tied embeddings, gated or plain MLP and, for a mixture of experts, the routed experts, how
        many a token uses, their width, shared experts and leading dense layers (each under any of the names
        architectures give it)."""
        h = _field(config, "hidden_size")
        heads = _field(config, "num_attention_heads")
        model_type = getattr(config, "model_type", None)
        experts = _field(config, "num_experts", 0)
        expert_inter = shared = dense = active = 0
        if experts:
            active = _field(config, "num_experts_per_tok", 2)
            expert_inter = _field(config, "moe_intermediate_size", 0) or _field(config, "intermediate_size")
            shared = (
                _field(config, "shared_expert_intermediate_size", 0)
                or _field(config, "n_shared_experts", 0) * expert_inter
            )
            dense = _field(config, "first_k_dense_replace", 0) or len(getattr(config, "mlp_only_layers", None) or ())
        return cls(
            layers=_field(config, "num_hidden_layers"),
            hidden=h,
            heads=heads,
            kv_heads=_field(config, "num_key_value_heads", heads),
            intermediate=_field(config, "intermediate_size", 4 * h),
            vocab=_field(config, "vocab_size"),
            head_dim=_field(config, "head_dim", 0) or h // heads,
            tied=_tied(config, model_type),
            mlp_matrices=2 if model_type in NON_GATED_MLPS else 3,
            experts=experts,
            active_experts=active,
            expert_intermediate=expert_inter,
            shared_intermediate=shared,
            dense_layers=dense,
        )

    @property
    def q_dim(self) -> int:
        """Width of the query (and attention output) projection: ``heads · head_dim``."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key (or value) projection: ``kv_heads · head_dim``."""
        return self.kv_heads * self.head_dim

    @property
    def moe(self) -> bool:
        """Whether the model is a mixture of experts."""
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts."""
        return self.layers - self.dense_layers if self.experts else 0

    @property
    def active_params(self) -> int:
        """Parameters one token's matmuls touch: all but the experts it is not routed to (``params`` when dense).
        The total scales the count of the shape's own dimensions, so a shape whose ``params`` was given by hand
        keeps its proportions."""
        if not self.moe:
            return self.params
        return round(self.params * count_params(self, active_only=True) / count_params(self))

    def pipeline_params(self, pp: int) -> int:
        """The parameter count whose even share over ``pp`` pipeline stages is the busiest stage's. The layers
        split evenly, and each end stage holds a whole ``vocab × hidden`` table: the embedding on the first, the
        output head on the last. A tied model's last stage holds a second copy of its embedding
        (:func:`loomrl.plan.shards.pp_stages`), and a value model (counted as a causal LM) holds its embedding
        on the first, so both count one table more than :attr:`params` at ``pp > 1``; an untied model at
        ``pp > 2`` counts its two tables on the ends, not spread over every stage."""
        if pp == 1:
            return self.params
        return self.params + (pp - (1 if self.tied else 2)) * self.vocab * self.hidden

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: the active ones but the input embedding (a table
        lookup), which an untied model holds apart from its output head."""
        return max(self.active_params - (0 if self.tied else self.vocab * self.hidden), 1)

    @property
    def attention_params(self) -> int:
        """One layer's attention projections: q and o (``hidden × heads·head_dim``), k and v (``kv_heads·head_dim``)."""
        return self.hidden * self.head_dim * 2 * (self.heads + self.kv_heads)

    @property
    def one_expert_params(self) -> int:
        """One routed expert's parameters (a gated MLP of its width)."""
        return 3 * self.hidden * self.expert_intermediate

    @property
    def expert_params(self) -> int:
        """Parameters of every routed expert (0 when dense): what expert parallelism divides."""
        return self.moe_layers * self.experts * self.one_expert_params

    @property
    def tensor_count(self) -> int:
        """Parameter tensors of the HF model (each routed expert's three matrices apart): what a per-tensor weight
        sync handles one by one."""
        per_layer = 6 + (self.mlp_matrices if not self.moe else 0)  # four projections, two norms, the MLP
        moe = self.experts * 3 + 1 + (3 if self.shared_intermediate else 0)  # experts, router, shared expert
        return (
            self.layers * per_layer
            + self.moe_layers * moe
            + (self.layers - self.moe_layers) * (self.mlp_matrices if self.moe else 0)
            + (2 if self.tied else 3)
        )

    def with_lora(self, rank: int, targets: tuple[str, ...]) -> ModelShape:
        """This model with LoRA adapters of ``rank`` on ``targets`` (rank 0: without)."""
        return dataclasses.replace(self, lora_rank=rank, lora_targets=tuple(targets) if rank else ())

    def _projections(self, dims: dict[str, int]) -> dict[str, tuple[int, int]]:
        """Each dense layer's projections: name → (input width, output width)."""
        h, q, kv, inter = dims["hidden"], dims["q"], dims["kv"], dims["intermediate"]
        out = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        out |= {"up_proj": (h, inter), "down_proj": (inter, h)}
        if self.mlp_matrices == 3:
            out["gate_proj"] = (h, inter)
        return out

    @property
    def adapter_params(self) -> int:
        """Parameters of the LoRA adapters (r × (in + out) per targeted projection per layer; 0 without)."""
        if not self.lora_rank:
            return 0
        return sum(math.prod(shape) for shape in self.moving_shapes().values())

    @property
    def trained_params(self) -> int:
        """Parameters with gradients and optimizer state: the adapters of a LoRA model, else all of them."""
        return self.adapter_params if self.lora_rank else self.params

    def moving_shapes(
        self, layers: int | None = None, dims: dict[str, int] | None = None
    ) -> dict[str, tuple[int, ...]]:
        """The parameters a trained role moves between layouts (:meth:`param_shapes` arguments): all of them, or
        a LoRA model's adapters (``lora_A`` r × in, ``lora_B`` out × r, named as peft names them)."""
        if not self.lora_rank:
            return self.param_shapes(layers, dims)
        full = {
            "hidden": self.hidden,
            "q": self.q_dim,
            "kv": self.kv_dim,
            "intermediate": self.intermediate,
            **(dims or {}),
        }
        r, shapes = self.lora_rank, dict[str, tuple[int, ...]]()
        for i in range(self.layers if layers is None else layers):
            for name, (fan_in, fan_out) in self._projections(full).items():
                if name in self.lora_targets:
                    where = f"model.layers.{i}.{'self_attn' if name[0] in 'qkvo' else 'mlp'}.{name}"
                    shapes[f"{where}.lora_A.default.weight"] = (r, fan_in)
                    shapes[f"{where}.lora_B.default.weight"] = (fan_out, r)
        return shapes

    def param_shapes(self, layers: int | None = None, dims: dict[str, int] | None = None) -> dict[str, tuple[int, ...]]:
        """HF Llama-style parameter names → shapes, in model order (a plain MLP has no ``gate_proj``, a tied model
        no ``lm_head``, a mixture-of-experts layer its experts stacked in two tensors). ``layers`` and ``dims``
        (keys ``hidden``, ``q``, ``kv``, ``intermediate``, ``vocab``, ``experts``: the experts' stacked width)
        override the true sizes: the reallocation coster plans a reduced copy of the model and scales its bytes
        back (see :mod:`loomrl.planner.cost.realloc`)."""
        d = {
            "hidden": self.hidden,
            "q": self.q_dim,
            "kv": self.kv_dim,
            "intermediate": self.intermediate,
            "vocab": self.vocab,
            "experts": self.experts * self.expert_intermediate,
        }
        d.update(dims or {})
        h, q, kv, inter, vocab = d["hidden"], d["q"], d["kv"], d["intermediate"], d["vocab"]
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
        count = self.layers if layers is None else layers
        dense = round(self.dense_layers * count / self.layers)
        for i in range(count):
            p = f"model.layers.{i}."
            shapes.update(
                {
                    p + "input_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h),
                    p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h),
                    p + "self_attn.o_proj.weight": (h, q),
                    p + "post_attention_layernorm.weight": (h,),
                }
            )
            if self.moe and i >= dense:
                shapes.update(
                    {
                        p + "mlp.experts.gate_up_proj": (2 * d["experts"], h),
                        p + "mlp.experts.down_proj": (h, d["experts"]),
                    }
                )
                continue
            if self.mlp_matrices == 3:
                shapes[p + "mlp.gate_proj.weight"] = (inter, h)
            shapes.update({p + "mlp.up_proj.weight": (inter, h), p + "mlp.down_proj.weight": (h, inter)})
        shapes["model.norm.weight"] = (h,)
        if not self.tied:
            shapes["lm_head.weight"] = (vocab, h)
        return shapes


def count_params(shape: ModelShape, active_only: bool = False) -> int:
    """Parameters of a model of ``shape``'s dimensions (:func:`param_count`); ``active_only`` counts only the
    experts a token passes through, what a token's matmuls touch."""
    d = shape
    mlp = d.mlp_matrices * d.hidden * d.intermediate
    moe = (
        (d.active_experts if active_only else d.experts) * d.one_expert_params
        + d.hidden * d.experts
        + 3 * d.hidden * d.shared_intermediate
    )
    per_layer = d.attention_params + 2 * d.hidden
    tables = (1 if d.tied else 2) * d.vocab * d.hidden
    return tables + d.layers * per_layer + (d.layers - d.moe_layers) * mlp + d.moe_layers * moe + d.hidden


def param_count(config: object) -> int:
    """Parameters of a decoder-only transformer described by an HF-config-like object
    (:meth:`ModelShape.from_config`).

    Embedding and, unless tied, an output projection (``vocab · h`` each), and per layer: attention
    (:attr:`ModelShape.attention_params`), an MLP of three ``h × I`` matrices (two for :data:`NON_GATED_MLPS`)
    or, in a mixture-of-experts layer, every routed expert, the router and the shared experts, and two norm
    vectors; plus the final norm. Biases and learned position embeddings are ignored (≪ 1%).
    """
    return ModelShape.from_config(config).params


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"model_shape.{name}: {value!r} is not a positive integer")


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
    return int(value)  # type: ignore[call-overload]


def _tied(config: object, model_type: object) -> bool:
    """The config's ``tie_word_embeddings``; where a plain ``config.json`` leaves it out, the default of its
    architecture in transformers (tied for GPT-2 and OPT, untied for the Llama family)."""
    value = getattr(config, "tie_word_embeddings", None)
    return bool(value) if value is not None else model_type in ("gpt2", "opt")
