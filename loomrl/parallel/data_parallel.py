"""Data parallelism by summing gradients: each rank back-propagates its own rows, then gradients are all-reduced.

Why a SUM and not DDP's average: the training loop scales each rank's token-mean loss by that rank's share of
the minibatch's tokens, ``loss_r = mean_r × tokens_r / tokens_total``. Summed over ranks this is exactly the
token-mean of the whole minibatch, the loss of the single-process reference, so the summed gradient is exactly
its gradient even when ranks hold different numbers of tokens (RL responses vary in length). DDP divides by the
world size, which is right only when every rank holds the same number of tokens.

Gradients are summed in fp32 at least: 16-bit (bf16) gradients are upcast for the all-reduce and rounded once
after it, as verl's FSDP ``reduce_dtype`` and Megatron's fp32 gradient reduction do, so a sum over n ranks does
not round at every hop of the ring (twice the bytes of a bf16 all-reduce, which the cost model prices).

Gradients travel in a few flat buffers per dtype (one collective per bucket, not per parameter). For a
tensor-parallel model each rank sums the gradient of its own shard with the ranks of its DP group, which hold
the same shard, so DTensor parameters are handled through their local tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from loomrl.parallel.main_grad import grad_of, zero_fill

DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024
"""Largest flat buffer all-reduced at once: few collectives, bounded temporary memory."""


def sync_gradients(model: nn.Module, dp_group: dist.ProcessGroup, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """All-reduce (SUM) every parameter's gradient over ``dp_group``; a no-op for a group of one rank.

    A parameter that has a gradient on some rank but not on this one (e.g. this rank had no rows) joins the sum
    with zeros; one that has no gradient on any rank keeps ``grad = None``, as the optimizer expects.
    """
    if dist.get_world_size(dp_group) == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    _agree_on_gradients(params, dp_group)
    grads = [local_shard(grad_of(p)) for p in params if grad_of(p) is not None]
    for bucket in buckets(grads, bucket_bytes, lambda g: g.numel() * reduce_dtype(g.dtype).itemsize):
        flat = torch.cat([g.reshape(-1) for g in bucket]).to(reduce_dtype(bucket[0].dtype))
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=dp_group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))  # rounds a 16-bit gradient once
            offset += g.numel()


def reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype gradients of ``dtype`` are summed in over the data-parallel group: fp32 or wider."""
    return torch.promote_types(dtype, torch.float32)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard (a view, so writing to it updates the DTensor)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _agree_on_gradients(params: list[nn.Parameter], dp_group: dist.ProcessGroup) -> None:
    """Give zero gradients to parameters that have one on another rank, so every rank reduces the same list.

    One tiny collective even when this rank has every gradient: only the group knows whether another lacks one.
    """
    if not params:
        return
    has_grad = torch.tensor(
        [grad_of(p) is not None for p in params], dtype=torch.int32, device=local_shard(params[0]).device
    )
    dist.all_reduce(has_grad, op=dist.ReduceOp.MAX, group=dp_group)
    for p, anyone in zip(params, has_grad.tolist()):
        if anyone and grad_of(p) is None:
            zero_fill(p)


def buckets(
    tensors: list[torch.Tensor],
    bucket_bytes: int,
    nbytes_of: Callable[[torch.Tensor], int] = lambda t: t.numel() * t.element_size(),
) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of same-dtype, same-device tensors of at most ``bucket_bytes`` as counted by
    ``nbytes_of`` (their size by default), or one larger tensor alone."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in tensors:
        nbytes = nbytes_of(g)
        same_kind = not bucket or (g.dtype == bucket[0].dtype and g.device == bucket[0].device)
        if bucket and (not same_kind or size + nbytes > bucket_bytes):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += nbytes
    if bucket:
        yield bucket
