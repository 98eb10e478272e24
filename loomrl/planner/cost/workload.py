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
from statistics import NormalDist

from loomrl.errors import ConfigError
from loomrl.plan import param_count
from loomrl.plan.memory import ModelDims, count_params, expert_params, model_dims

__all__ = ["DEFAULT_SPREAD", "ModelShape", "Workload", "lengths_from_mean_max"]

DEFAULT_SPREAD = 0.75
"""σ of the log-normal response lengths when only their mean and maximum are known: the 99th percentile about
5.7 times the median before truncation. A stated assumption of the shape, not a measured one: publications
give the mean and the limit, rarely the distribution."""


def _positive_int(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{owner}.{name}: {value!r} is not a positive integer")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer as the cost model sees it: GQA attention with any head width, a gated or plain
    MLP, or a mixture of experts (:class:`loomrl.plan.memory.ModelDims` names the same dimensions)."""

    params: int
    """Parameters in all (see :func:`loomrl.plan.param_count`); every expert counts."""
    layers: int
    """Decoder layers."""
    hidden: int
    """Hidden size."""
    heads: int
    """Attention (query) heads."""
    kv_heads: int
    """Key/value heads (grouped-query attention; equal to ``heads`` without it)."""
    intermediate: int
    """MLP intermediate size (of the dense layers, for a mixture of experts)."""
    vocab: int
    """Vocabulary size."""
    head_dim: int = 0
    """Width of one attention head; 0 (the default) is set to ``hidden / heads``, which must then divide."""
    tied: bool = False
    """Whether the output head is the input embedding table."""
    mlp_matrices: int = 3
    """3 for a gated MLP (gate, up, down: Llama, Qwen), 2 for a plain one (GPT-2, OPT)."""
    experts: int = 0
    """Routed experts per mixture-of-experts layer; 0 for a dense model."""
    active_experts: int = 0
    """Experts each token is routed to (top-k)."""
    expert_intermediate: int = 0
    """One expert's MLP width."""
    shared_intermediate: int = 0
    """Width of the shared experts every token passes through (0: none)."""
    dense_layers: int = 0
    """Leading layers with a dense MLP in a mixture-of-experts model."""

    def __post_init__(self) -> None:
        for name in ("params", "layers", "hidden", "heads", "kv_heads", "intermediate", "vocab"):
            _positive_int("model_shape", name, getattr(self, name))
        if not self.head_dim and self.hidden % self.heads:
            raise ConfigError(f"model_shape.heads: {self.heads} does not divide hidden={self.hidden} (give head_dim)")
        if self.experts and not 0 < self.active_experts <= self.experts:
            raise ConfigError(f"model_shape.active_experts: {self.active_experts!r} is not in 1..experts={self.experts}")
        if self.experts and self.expert_intermediate < 1:
            raise ConfigError(f"model_shape.expert_intermediate: {self.expert_intermediate!r} is not a positive integer")
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.mlp_matrices not in (2, 3):
            raise ConfigError(f"model_shape.mlp_matrices: {self.mlp_matrices!r}; valid: 2 (plain MLP), 3 (gated)")

    @classmethod
    def from_config(cls, config: object) -> ModelShape:
        """Read an HF config (a transformers config object or a ``config.json`` read as attributes; see
        :func:`loomrl.plan.memory.model_dims` for the fields and their aliases)."""
        d = model_dims(config)
        return cls(params=param_count(config), layers=d.layers, hidden=d.hidden, heads=d.heads, kv_heads=d.kv_heads,
                   intermediate=d.intermediate, vocab=d.vocab, head_dim=d.head_dim, tied=d.tied,
                   mlp_matrices=d.mlp_matrices, experts=d.experts, active_experts=d.active_experts,
                   expert_intermediate=d.expert_intermediate, shared_intermediate=d.shared_intermediate,
                   dense_layers=d.dense_layers)

    @property
    def dims(self) -> ModelDims:
        """The same dimensions as :class:`loomrl.plan.memory.ModelDims` (what parameter counts take)."""
        return ModelDims(self.hidden, self.layers, self.heads, self.kv_heads, self.head_dim, self.intermediate,
                         self.vocab, self.tied, self.mlp_matrices, self.experts, self.active_experts,
                         self.expert_intermediate, self.shared_intermediate, self.dense_layers)

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
    def active_params(self) -> int:
        """Parameters one token's matmuls touch: all but the experts it is not routed to (``params`` when dense).
        The total scales the count of the shape's own dimensions, so a shape whose ``params`` was given by hand
        keeps its proportions."""
        if not self.moe:
            return self.params
        return round(self.params * count_params(self.dims, active_only=True) / count_params(self.dims))

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: the active ones but the input embedding (a table
        lookup), which an untied model holds apart from its output head."""
        return max(self.active_params - (0 if self.tied else self.vocab * self.hidden), 1)

    @property
    def expert_params(self) -> int:
        """Parameters of every routed expert (0 when dense): what expert parallelism divides."""
        return self.dims.moe_layers * self.experts * expert_params(self.dims)

    @property
    def tensor_count(self) -> int:
        """Parameter tensors of the HF model (each routed expert's three matrices apart): what a per-tensor weight
        sync handles one by one."""
        per_layer = 6 + (self.mlp_matrices if not self.moe else 0)  # four projections, two norms, the MLP
        moe = self.experts * 3 + 1 + (3 if self.shared_intermediate else 0)  # experts, router, shared expert
        return self.layers * per_layer + self.dims.moe_layers * moe + (self.layers - self.dims.moe_layers) * (
            self.mlp_matrices if self.moe else 0) + (2 if self.tied else 3)

    def param_shapes(self, layers: int | None = None,
                     dims: dict[str, int] | None = None) -> dict[str, tuple[int, ...]]:
        """HF Llama-style parameter names → shapes, in model order (a plain MLP has no ``gate_proj``, a tied model
        no ``lm_head``, a mixture-of-experts layer its experts stacked in two tensors). ``layers`` and ``dims``
        (keys ``hidden``, ``q``, ``kv``, ``intermediate``, ``vocab``, ``experts``: the experts' stacked width)
        override the true sizes: the reallocation coster plans a reduced copy of the model and scales its bytes
        back (see :mod:`loomrl.planner.cost.realloc`)."""
        d = {"hidden": self.hidden, "q": self.q_dim, "kv": self.kv_dim, "intermediate": self.intermediate,
             "vocab": self.vocab, "experts": self.experts * self.expert_intermediate}
        d.update(dims or {})
        h, q, kv, inter, vocab = d["hidden"], d["q"], d["kv"], d["intermediate"], d["vocab"]
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
        count = self.layers if layers is None else layers
        dense = round(self.dense_layers * count / self.layers)
        for i in range(count):
            p = f"model.layers.{i}."
            shapes.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                           p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                           p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,)})
            if self.moe and i >= dense:
                shapes.update({p + "mlp.experts.gate_up_proj": (2 * d["experts"], h),
                               p + "mlp.experts.down_proj": (h, d["experts"])})
                continue
            if self.mlp_matrices == 3:
                shapes[p + "mlp.gate_proj.weight"] = (inter, h)
            shapes.update({p + "mlp.up_proj.weight": (inter, h), p + "mlp.down_proj.weight": (h, inter)})
        shapes["model.norm.weight"] = (h,)
        if not self.tied:
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
    rollout_scale: float = 1.0
    """Samples generated and scored per sample trained: above 1 under dynamic sampling, whose waves generate and
    score more prompts than the batch keeps (a run's ``sampling/prompts`` over ``rollout.prompts_per_iter``). The
    generate calls and the call that makes the rewards are priced that many times over (waves run one after
    another, each about a batch or less: linear in the waves, which slightly overprices a memory-bound decode
    whose steps cost little more for more samples)."""
    samples_per_prompt: int = 1
    """Samples sharing each prompt (a GRPO/RLOO group): a runtime that computes a shared prompt once in its
    training and scoring passes (:attr:`~loomrl.planner.cost.system.SystemSettings.shared_prompts`) processes
    ``prompt_len / samples_per_prompt`` prompt tokens per sample there."""

    def __post_init__(self) -> None:
        _positive_int("workload", "batch", self.batch)
        _positive_int("workload", "ppo_epochs", self.ppo_epochs)
        _positive_int("workload", "minibatches", self.minibatches)
        _positive_int("workload", "samples_per_prompt", self.samples_per_prompt)
        if self.decode_slots is not None:
            _positive_int("workload", "decode_slots", self.decode_slots)
        scale = self.rollout_scale
        if isinstance(scale, bool) or not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale >= 1):
            raise ConfigError(f"workload.rollout_scale: {scale!r} is not a number >= 1 (samples generated per sample "
                              "trained)")
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


def lengths_from_mean_max(mean: float, longest: int, spread: float = DEFAULT_SPREAD, n: int = 200) -> tuple[int, ...]:
    """``n`` response lengths (the quantiles ``(i + ½)/n``) of a log-normal of log-scale ``spread``, cut at
    ``longest`` (a sample that reaches the limit stops there, as a generation limit does), whose mean is
    ``mean``: the location is found by bisection, since the cut mean grows with it. A mean at or above the
    limit gives every sample the limit."""
    if isinstance(longest, bool) or not isinstance(longest, int) or longest < 1:
        raise ConfigError(f"workload.response_max: {longest!r} is not a positive integer")
    if not (isinstance(mean, (int, float)) and 1 <= mean and math.isfinite(mean)):
        raise ConfigError(f"workload.response_mean: {mean!r} is not a number of at least 1")
    if not (isinstance(spread, (int, float)) and spread > 0 and math.isfinite(spread)):
        raise ConfigError(f"workload.response_spread: {spread!r} is not a positive number")
    if mean >= longest:
        return (longest,) * n
    z = [NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)]

    def sample(mu: float) -> list[int]:
        return [min(longest, max(1, round(math.exp(mu + spread * q)))) for q in z]

    low, high = -10.0, math.log(longest) + 6 * spread
    for _ in range(100):
        mid = (low + high) / 2
        if sum(sample(mid)) / n < mean:
            low = mid
        else:
            high = mid
    return tuple(sample(high))
