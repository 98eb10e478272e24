"""fp32 gradients for 16-bit parameters (Megatron's ``main_grad``).

Autograd accumulates a bf16 parameter's gradient in bf16: every micro-batch (or pipeline micro-batch) added
to it rounds the sum to 8 significant bits. :func:`accumulate_in_fp32` gives each 16-bit parameter a hook
that moves each gradient autograd has just accumulated into an fp32 ``main_grad`` attribute (adding it to the
sum so far) and clears ``.grad``, so a minibatch's micro-batches add in fp32, the data-parallel sum runs on
the fp32 sums, clipping scales them, and the optimizer's fp32 master weights take them without rounding: as
Megatron-LM and DeepSpeed do for bf16 training.

Whatever reads or resets gradients goes through :func:`grad_of`, :func:`zero_fill` and :func:`clear_grad`,
which fall back to ``.grad`` for parameters without the hook (fp32 models are untouched). A tensor-parallel
(DTensor) parameter's ``main_grad`` is a DTensor with the gradient's placements.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["accumulate_in_fp32", "clear_grad", "grad_of", "set_grad", "zero_fill"]

MAIN_GRAD = "main_grad"


def accumulate_in_fp32(model: nn.Module) -> int:
    """Hook every trainable 16-bit parameter of ``model``; returns how many were hooked."""
    hooked = 0
    for p in model.parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype.itemsize < 4 and not hasattr(p, MAIN_GRAD):
            setattr(p, MAIN_GRAD, None)
            p.register_post_accumulate_grad_hook(_into_main_grad)
            hooked += 1
    return hooked


def _into_main_grad(p: torch.Tensor) -> None:
    grad = p.grad.float()
    main = getattr(p, MAIN_GRAD)
    setattr(p, MAIN_GRAD, grad if main is None else main.add_(grad))
    p.grad = None


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient to sum, clip and step with: the fp32 ``main_grad`` of a hooked parameter, else ``.grad``."""
    return getattr(p, MAIN_GRAD) if hasattr(p, MAIN_GRAD) else p.grad


def set_grad(p: torch.Tensor, grad: torch.Tensor) -> None:
    """Make ``grad`` the gradient of ``p`` (its ``main_grad`` where it keeps one)."""
    if hasattr(p, MAIN_GRAD):
        setattr(p, MAIN_GRAD, grad)
    else:
        p.grad = grad


def zero_fill(p: torch.Tensor) -> None:
    """Give ``p`` a zero gradient (a rank without rows still joins the data-parallel sum)."""
    if hasattr(p, MAIN_GRAD):
        setattr(p, MAIN_GRAD, torch.zeros_like(p, dtype=torch.float32))
    else:
        p.grad = torch.zeros_like(p)


def clear_grad(p: torch.Tensor) -> None:
    """Drop ``p``'s gradient before the next minibatch."""
    p.grad = None
    if hasattr(p, MAIN_GRAD):
        setattr(p, MAIN_GRAD, None)
