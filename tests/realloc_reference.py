"""The reference of the reallocation tests (``tests/test_realloc.py``, ``tests/test_realloc_gloo.py``): what each
rank of an allocation must hold of a full parameter, computed with tensor operations (``narrow`` over the TP dim,
then a flat chunk under FSDP) independently of :mod:`loomrl.plan.shards`."""

from __future__ import annotations

import torch

from loomrl.plan import Allocation
from loomrl.plan.layout import Layout
from loomrl.plan.shards import tp_dim


def place(mesh, layout: Layout, fsdp: bool = False, zero: bool = False) -> Allocation:
    """An allocation on ``mesh`` (its devices sorted: rank r runs on the r-th smallest)."""
    return Allocation(tuple(sorted(mesh)), layout, fsdp=fsdp, zero=zero)


def reference_shard(
    full: torch.Tensor,
    name: str,
    alloc: Allocation,
    rank: int,
    num_layers: int,
    state: bool = False,
    tied: bool = False,
) -> torch.Tensor | None:
    """What ``rank`` of ``alloc`` must hold of ``full`` (of its weights, or with ``state`` of its optimizer
    state), by tensor slicing (None: another PP stage). ``tied``: the input embedding is the output head's too,
    held by the first and the last stage."""
    layout = alloc.layout
    pp_rank, dp_rank, tp_rank = layout.coords(rank)
    last = layout.pp - 1
    if name.endswith("embed_tokens.weight"):
        stages = {0, last} if tied else {0}
    elif ".layers." in name:
        stages = {int(name.split(".layers.")[1].split(".")[0]) // (num_layers // layout.pp)}
    else:
        stages = {last}
    if pp_rank not in stages:
        return None
    dim, part = tp_dim(name), full
    if dim is not None:
        step = -(-full.shape[dim] // layout.tp)  # torch.chunk / DTensor Shard block size
        start = min(tp_rank * step, full.shape[dim])
        part = full.narrow(dim, start, min(step, full.shape[dim] - start))
    split = alloc.dp_split(state)
    if split == "rows":  # FSDP2: a torch.chunk block of dim 0 of the (tp) local tensor
        step = -(-part.shape[0] // layout.dp)
        start = min(dp_rank * step, part.shape[0])
        part = part.narrow(0, start, min(step, part.shape[0] - start))
    elif split == "flat":  # ZeRO-1's optimizer state: a torch.chunk block of the flattened local tensor
        flat = part.reshape(-1)
        step = -(-flat.numel() // layout.dp)
        start = min(dp_rank * step, flat.numel())
        part = flat[start : start + step]
    return part
