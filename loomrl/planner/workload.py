"""What the cost model prices: the shape of each role's model and the shape of one iteration's data.

- :class:`ModelShape`: the few numbers of a decoder-only transformer the analytic terms need, read from an
  HF-config-like object (:meth:`ModelShape.from_config`), plus the HF parameter names and shapes the
  reallocation planner works on (:meth:`ModelShape.param_shapes`).
- :class:`Workload`: samples per iteration, prompt length, and a *sample* of the response-length
  distribution (not one length: decode cost under continuous batching depends on the whole distribution,
  the tail most of all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loomrl.errors import ConfigError
from loomrl.plan import param_count

__all__ = ["ModelShape", "Workload"]


def _positive_int(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{owner}.{name}: {value!r} is not a positive integer")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer as the cost model sees it (Llama-style: GQA attention, gated MLP)."""

    params: int
    """Parameters in all (see :func:`loomrl.plan.param_count`)."""
    layers: int
    """Decoder layers."""
    hidden: int
    """Hidden size."""
    heads: int
    """Attention (query) heads."""
    kv_heads: int
    """Key/value heads (grouped-query attention; equal to ``heads`` without it)."""
    intermediate: int
    """MLP intermediate size."""
    vocab: int
    """Vocabulary size."""

    def __post_init__(self) -> None:
        for name in ("params", "layers", "hidden", "heads", "kv_heads", "intermediate", "vocab"):
            _positive_int("model_shape", name, getattr(self, name))
        if self.hidden % self.heads:
            raise ConfigError(f"model_shape.heads: {self.heads} does not divide hidden={self.hidden}")

    @classmethod
    def from_config(cls, config: object) -> ModelShape:
        """Read an HF config (or any object with its field names): ``hidden_size``, ``num_hidden_layers``,
        ``num_attention_heads``, ``num_key_value_heads`` (default: heads), ``intermediate_size`` (default:
        4·hidden), ``vocab_size``."""
        hidden = int(config.hidden_size)
        heads = int(config.num_attention_heads)
        return cls(
            params=param_count(config),
            layers=int(config.num_hidden_layers),
            hidden=hidden,
            heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            intermediate=int(getattr(config, "intermediate_size", None) or 4 * hidden),
            vocab=int(config.vocab_size),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of the key (or value) projection: ``kv_heads · head_dim``."""
        return self.kv_heads * self.head_dim

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: all but the input embedding (a table lookup)."""
        return max(self.params - self.vocab * self.hidden, 1)

    def param_shapes(self, layers: int | None = None,
                     dims: dict[str, int] | None = None) -> dict[str, tuple[int, ...]]:
        """HF Llama parameter names → shapes, in model order. ``layers`` and ``dims`` (keys ``hidden``,
        ``kv``, ``intermediate``, ``vocab``) override the true sizes: the reallocation coster plans a
        reduced copy of the model and scales its bytes back (see :mod:`loomrl.planner.realloc_cost`)."""
        d = {"hidden": self.hidden, "kv": self.kv_dim, "intermediate": self.intermediate, "vocab": self.vocab}
        d.update(dims or {})
        h, kv, inter, vocab = d["hidden"], d["kv"], d["intermediate"], d["vocab"]
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
        for i in range(self.layers if layers is None else layers):
            p = f"model.layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, h),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            })
        shapes["model.norm.weight"] = (h,)
        shapes["lm_head.weight"] = (vocab, h)
        return shapes


@dataclass(frozen=True)
class Workload:
    """One iteration's data: how many samples, how long their prompts and responses are."""

    batch: int
    """Samples per iteration (prompts × samples per prompt)."""
    prompt_len: float
    """Mean prompt length in tokens."""
    response_lengths: tuple[int, ...]
    """A sample of the response-length distribution in tokens (e.g. last iteration's lengths); scaled to
    ``batch``, it says how many samples are still decoding at each step."""
    ppo_epochs: int = 1
    """Passes over the batch of a train call, unless the MFC sets its own ``epochs``."""
    minibatches: int = 1
    """Optimizer steps per pass of a train call, unless the MFC sets its own ``minibatches``."""
    decode_slots: int | None = None
    """Samples one generation replica decodes at once (the rollout engine's slots); None: all of its share."""

    def __post_init__(self) -> None:
        _positive_int("workload", "batch", self.batch)
        _positive_int("workload", "ppo_epochs", self.ppo_epochs)
        _positive_int("workload", "minibatches", self.minibatches)
        if self.decode_slots is not None:
            _positive_int("workload", "decode_slots", self.decode_slots)
        prompt = self.prompt_len
        if isinstance(prompt, bool) or not (isinstance(prompt, (int, float)) and prompt >= 0 and math.isfinite(prompt)):
            raise ConfigError(f"workload.prompt_len: {self.prompt_len!r} is not a non-negative number")
        lengths = tuple(self.response_lengths)
        if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
            raise ConfigError(f"workload.response_lengths: {self.response_lengths!r} is not a non-empty list of "
                              "positive integers")
        object.__setattr__(self, "response_lengths", lengths)

    @property
    def mean_response(self) -> float:
        return sum(self.response_lengths) / len(self.response_lengths)

    @property
    def max_response(self) -> int:
        return max(self.response_lengths)

    @property
    def mean_seq(self) -> float:
        """Mean tokens of a whole sample (prompt + response), what train and inference calls process."""
        return self.prompt_len + self.mean_response

    @property
    def mean_sq_seq(self) -> float:
        """Mean of the squared sample length; causal attention's FLOPs grow with it."""
        return sum((self.prompt_len + n) ** 2 for n in self.response_lengths) / len(self.response_lengths)
