"""Log-probs and entropies of chosen tokens straight from hidden states: the output head a chunk of tokens at a time.

A policy's losses read, per response token, the log-prob of that token and the entropy of its distribution: two
numbers out of a vocabulary-wide row of logits. Materialising the rows for every token (and their float32 copy,
their softmax, and the gradients of each) costs memory of tokens × vocabulary: on a 49k vocabulary, 128 samples ×
64 tokens hold 1.6 GB per float32 copy, and a pass holds several. Here the head runs over :data:`CHUNK_TOKENS`
tokens at a time in the forward, keeping only the two numbers, and again in the backward, which recomputes each
chunk's logits and turns them into the gradients of the hidden states and of the head's weight at once (Liger's
fused linear cross-entropy and verl's fused kernels do the same on GPUs; none of them ships a CPU path or the
entropy's gradient, so it is written here, in plain torch ops that run on any device).

The arithmetic per chunk is that of the unfused path (the head's matrix product in the weight's dtype, then
float32), so the values are the same; the backward's sums run in another order.

Legend: N tokens, H hidden size, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["CHUNK_TOKENS", "chunked_logprobs_and_entropy", "fuses"]

CHUNK_TOKENS = 1024
"""Tokens whose logits live at once: 1024 × 49,152 float32 logits are 200 MB."""


def fuses(head: nn.Module) -> bool:
    """Whether :func:`chunked_logprobs_and_entropy` computes what ``head`` would: a bias-free linear layer over a
    plain (unsharded) weight."""
    return (
        type(head) is nn.Linear
        and head.bias is None
        and type(head.weight.data) is torch.Tensor  # a DTensor (tensor-parallel shard) is a subclass
    )


def chunked_logprobs_and_entropy(
    hidden_NH: torch.Tensor, weight_VH: torch.Tensor, target_N: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_N, entropy_N) in float32 under softmax(hidden @ weightᵀ / temperature), with their gradients, never
    holding more than :data:`CHUNK_TOKENS` rows of logits."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _ChunkedHead.apply(hidden_NH, weight_VH, target_N, float(temperature))


def _scaled_logits(hidden_CH: torch.Tensor, weight_VH: torch.Tensor, temperature: float) -> torch.Tensor:
    logits_CV = (hidden_CH @ weight_VH.t()).float()
    return logits_CV / temperature if temperature != 1.0 else logits_CV


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, target_N, temperature):
        n = hidden_NH.shape[0]
        logp_N = torch.empty(n, dtype=torch.float32, device=hidden_NH.device)
        entropy_N = torch.empty_like(logp_N)
        for start in range(0, n, CHUNK_TOKENS):
            rows = slice(start, start + CHUNK_TOKENS)
            scaled_CV = _scaled_logits(hidden_NH[rows], weight_VH, temperature)
            logz_C = torch.logsumexp(scaled_CV, dim=-1)
            logp_N[rows] = scaled_CV.gather(-1, target_N[rows, None]).squeeze(-1) - logz_C
            # H = logZ − Σ p·s, as heads.target_logprobs_and_entropy computes it
            entropy_N[rows] = logz_C - (torch.softmax(scaled_CV, dim=-1) * scaled_CV).sum(-1)
        ctx.save_for_backward(hidden_NH, weight_VH, target_N)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return logp_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logp_N, grad_entropy_N):
        hidden_NH, weight_VH, target_N = ctx.saved_tensors
        temperature = ctx.temperature
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logp_N is None and grad_entropy_N is None) or not (want_hidden or want_weight):
            return None, None, None, None
        grad_hidden_NH = torch.empty_like(hidden_NH) if want_hidden else None
        grad_weight_VH = (
            torch.zeros(weight_VH.shape, dtype=torch.float32, device=weight_VH.device) if want_weight else None
        )
        for start in range(0, hidden_NH.shape[0], CHUNK_TOKENS):
            rows = slice(start, start + CHUNK_TOKENS)
            scaled_CV = _scaled_logits(hidden_NH[rows], weight_VH, temperature)
            p_CV = torch.softmax(scaled_CV, dim=-1)
            grad_CV = torch.zeros_like(p_CV)
            if grad_logp_N is not None:  # d logp / d s = onehot(target) − p
                g_C1 = grad_logp_N[rows, None]
                grad_CV -= p_CV * g_C1
                grad_CV.scatter_add_(-1, target_N[rows, None], g_C1)
            if grad_entropy_N is not None:  # d H / d s = p · (E_p[s] − s)
                mean_C1 = (p_CV * scaled_CV).sum(-1, keepdim=True)
                grad_CV += grad_entropy_N[rows, None] * p_CV * (mean_C1 - scaled_CV)
            if temperature != 1.0:
                grad_CV /= temperature
            grad_CV = grad_CV.to(weight_VH.dtype)
            if want_hidden:
                grad_hidden_NH[rows] = grad_CV @ weight_VH
            if want_weight:
                grad_weight_VH += (grad_CV.t() @ hidden_NH[rows]).float()
        return grad_hidden_NH, grad_weight_VH.to(weight_VH.dtype) if want_weight else None, None, None
