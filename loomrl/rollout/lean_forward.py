"""The rollout engine's forward for Llama-style decoders: the model's own arithmetic, without its module layers.

A decode step of a small model is a few dozen small tensor operations per layer, and on a CPU (or a GPU without
graphs) the time between them (module calls, keyword plumbing, mask construction, the cache interface) costs as
much as the operations. This forward reads the model's own parameters and modules' constants and runs the same
operations as transformers' eager Llama forward (RMSNorm in float32, rotary embedding from the model's own
rotary module, softmax in float32, SiLU-gated MLP) in the same order and precision (a projection with LoRA
adapters runs its own module: the base and the adapters' update as peft computes them), with two differences in
form: grouped-query attention multiplies each key/value head with its query heads in one batched product instead
of copying the keys and values per query head, and the projections are called directly. A model that runs ``sdpa``
attention (on CUDA, :mod:`loomrl.models.attention`) gets ``scaled_dot_product_attention`` here too. It computes every
position's logits the model would, equal up to the rounding of those products (tests compare it with the
model's forward and with transformers' generation).

Only plain decoders take it: Llama, Mistral and Qwen2 (``model_type``), SiLU MLPs, no attention or MLP
extras; anything else (another architecture, a tensor-parallel or offloaded model, hooks on the modules) runs
the model's own forward (:func:`supports_lean_forward`).

Legend: B = rows, Q = new positions per row, K = key positions, H = hidden size, Hq/Hkv = query/key-value heads,
G = query heads per key-value head, D = head dim, V = vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import Cache, PreTrainedModel

from loomrl.models.attention import uses_sdpa

__all__ = ["lean_logits", "supports_lean_forward"]

_TYPES = ("llama", "mistral", "qwen2")


def supports_lean_forward(model: PreTrainedModel) -> bool:
    """Whether :func:`lean_logits` computes what this model's forward does."""
    config = model.config
    if getattr(config, "model_type", None) not in _TYPES or getattr(config, "hidden_act", None) != "silu":
        return False
    if (
        getattr(config, "sliding_window", None)
        and getattr(config, "use_sliding_window", True)
        and config.model_type != "llama"
    ):
        return False
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "layers") or not hasattr(model, "lm_head"):
        return False
    for module in model.modules():
        if module._forward_hooks or module._forward_pre_hooks:
            return False
    for p in model.parameters():
        if type(p.data) is not torch.Tensor or p.device.type == "meta":  # DTensor shards, offloaded weights
            return False
    layer = body.layers[0]
    expected = {"self_attn": {"q_proj", "k_proj", "v_proj", "o_proj"}, "mlp": {"gate_proj", "up_proj", "down_proj"}}
    return all(
        {n for n, _ in getattr(layer, part).named_children()} <= names | {"act_fn"} for part, names in expected.items()
    )


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    # transformers' LlamaRMSNorm (and Qwen2's, Mistral's): in float32, scaled back in the input's dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x32.to(x.dtype)


def _project(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    # a projection with LoRA adapters (a peft layer around the linear) runs its own forward: base plus update
    if type(module) is torch.nn.Linear:
        return F.linear(x, module.weight, module.bias)
    return module(x)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@torch.no_grad()
def lean_logits(
    model: PreTrainedModel,
    ids_BQ: torch.Tensor,
    pos_BQ: torch.Tensor,
    mask_B1QK: torch.Tensor,
    cache: Cache,
    last_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits_BQV of ``model`` for these rows, writing their keys and values through ``cache.update`` (as the
    model's forward does), with the additive mask ``mask_B1QK`` over the keys the cache returns. With ``last_B``
    (one column per row) only those positions' logits, B×V: a prefill samples from each row's last position, and
    the output head over the others' would be a fifth of the prefill's arithmetic and B×Q×V of memory."""
    body = model.model
    config = model.config
    rows, width = ids_BQ.shape
    h_BQH = F.embedding(ids_BQ, body.embed_tokens.weight)
    cos_BQD, sin_BQD = body.rotary_emb(h_BQH, pos_BQ)
    cos_B1QD, sin_B1QD = cos_BQD[:, None], sin_BQD[:, None]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    groups = heads // kv_heads
    mask_B11QK = mask_B1QK[:, :, None]
    sdpa = uses_sdpa(model)
    for index, layer in enumerate(body.layers):
        attn = layer.self_attn
        dim = attn.head_dim
        x_BQH = _rms_norm(layer.input_layernorm, h_BQH)
        q_BHQD = _project(attn.q_proj, x_BQH).view(rows, width, heads, dim).transpose(1, 2)
        k_BHQD = _project(attn.k_proj, x_BQH).view(rows, width, kv_heads, dim).transpose(1, 2)
        v_BHQD = _project(attn.v_proj, x_BQH).view(rows, width, kv_heads, dim).transpose(1, 2)
        q_BHQD = _rotate(q_BHQD, cos_B1QD, sin_B1QD)
        k_BHQD = _rotate(k_BHQD, cos_B1QD, sin_B1QD)
        keys_BHKD, values_BHKD = cache.update(k_BHQD, v_BHQD, index)
        if sdpa:  # one fused kernel; its query heads share their key/value head as below (enable_gqa)
            out = F.scaled_dot_product_attention(
                q_BHQD, keys_BHKD, values_BHKD, attn_mask=mask_B1QK, scale=attn.scaling, enable_gqa=groups > 1
            )
        else:
            # each key/value head against its G query heads at once: B x Hkv x (G*Q) x K, no per-head copies
            q_BhGQD = q_BHQD.reshape(rows, kv_heads, groups * width, dim)
            # the keys are a slice of the slot cache (rows strided by its full length): a CPU batched product
            # over that layout costs four times one over a packed copy, copy included
            scores = torch.matmul(q_BhGQD, keys_BHKD.contiguous().transpose(2, 3)) * attn.scaling
            scores = scores.view(rows, kv_heads, groups, width, -1) + mask_B11QK
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q_BHQD.dtype)
            out = torch.matmul(probs.view(rows, kv_heads, groups * width, -1), values_BHKD)
        out_BQX = out.reshape(rows, heads, width, dim).transpose(1, 2).reshape(rows, width, heads * dim)
        h_BQH = h_BQH + _project(attn.o_proj, out_BQX)
        x_BQH = _rms_norm(layer.post_attention_layernorm, h_BQH)
        mlp = layer.mlp
        gated = F.silu(_project(mlp.gate_proj, x_BQH)) * _project(mlp.up_proj, x_BQH)
        h_BQH = h_BQH + _project(mlp.down_proj, gated)
    if last_B is not None:
        h_BQH = h_BQH[torch.arange(rows, device=h_BQH.device), last_B]  # B×H: each row's one position
    h_BQH = _rms_norm(body.norm, h_BQH)
    return F.linear(h_BQH, model.lm_head.weight, model.lm_head.bias)
