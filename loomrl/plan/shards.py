"""Which part of every parameter each rank of a layout holds, as intervals of the parameter's flat index space.

Pure Python (no torch): the reallocation planner, the cost model and tests use it without a process group.

The conventions, shared with :mod:`loomrl.parallel.tensor_parallel` and the execution plan:

- A layout ``Layout(dp, tp, pp)`` placed on a mesh (an :class:`~loomrl.plan.plan.Allocation`'s sorted devices)
  puts rank ``r`` on device ``mesh[r]``, with ``r = pp_rank * (dp * tp) + dp_rank * tp + tp_rank`` (tp
  fastest, then dp: :meth:`Layout.coords`).
- Pipeline stages own contiguous, equal ranges of the decoder layers ``...layers.{i}.``; the input embedding
  lives on stage 0, everything else outside the layers (final norm, ``lm_head``, ``score``) on the last stage. An
  input embedding the output head shares (tied) lives on both (:func:`pp_stages`).
- Tensor parallelism splits q/k/v/gate/up projections column-wise (weight and bias along dim 0), o/down
  row-wise (weight along dim 1, bias replicated), ``embed_tokens`` and ``lm_head`` over the vocabulary
  (dim 0); everything else is replicated. A dim of size n is cut like ``torch.chunk`` (and DTensor's
  ``Shard``): blocks of ``ceil(n / tp)``, the last ones shorter or empty when tp does not divide n, which is
  equal blocks whenever it does.
- Both combine: a rank of a pp×tp layout holds its TP slice of the parameters of its stage only (as
  :func:`loomrl.parallel.pipeline.split_stages` followed by tensor parallelism leaves it).
- Data-parallel replicas hold full copies of their (tp, pp) shard (``split="none"``), or divide it
  (:meth:`~loomrl.plan.plan.Allocation.dp_split`): under FSDP (``"rows"``) each dp rank holds one
  ``torch.chunk``-style block of dim 0 of that shard, as FSDP2's ``fully_shard`` leaves it (its ``Shard(0)``
  placement: whole rows, so a row-major local tensor is still a run of whole rows); ZeRO-1's optimizer state
  (``"flat"``) is one ``torch.chunk``-style block of the shard's flattened elements per dp rank
  (:mod:`loomrl.parallel.zero`).

A rank's local tensor, flattened row-major, is the concatenation of the full parameter's flat elements over
its intervals in increasing order; that is what lets the executor pack and unpack pieces by offsets alone.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from loomrl.plan.layout import Layout

Interval = tuple[int, int]
"""Half-open ``[start, end)`` range of a parameter's row-major flat index space."""

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Suffixes of the parameters tensor parallelism splits, and the dim it splits them along.
_COLUMN_WISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_WISE = ("o_proj", "down_proj")
_VOCAB = ("embed_tokens", "lm_head")


def tp_dim(param_name: str) -> int | None:
    """The dim tensor parallelism splits ``param_name`` along, or None when it is replicated.

    A projection with LoRA adapters (``q_proj.base_layer.weight``, ``q_proj.lora_A.default.weight``) keeps its
    base split as the plain projection is; of its adapters, the one on the split side is split with it (``lora_B``'s
    output rows of a column-wise projection, ``lora_A``'s input columns of a row-wise one) and the other, r wide,
    is replicated (:mod:`loomrl.parallel.tensor_parallel`)."""
    parts = param_name.split(".")
    if len(parts) < 2:
        return None
    module, kind = parts[-2], parts[-1]
    if module == "base_layer" and len(parts) >= 3:
        module = parts[-3]
    elif len(parts) >= 4 and parts[-3] in ("lora_A", "lora_B"):
        adapter, projection = parts[-3], parts[-4]
        if projection in _COLUMN_WISE and adapter == "lora_B":
            return 0
        if projection in _ROW_WISE and adapter == "lora_A":
            return 1
        return None
    if module in _COLUMN_WISE or module in _VOCAB:
        return 0
    if module in _ROW_WISE and kind == "weight":
        return 1
    return None  # norms, score head, and row-wise biases (added after the all-reduce, so replicated)


def pp_stages(param_name: str, num_layers: int, pp: int, tied: bool = False) -> tuple[int, ...]:
    """The pipeline stages holding ``param_name`` when ``num_layers`` decoder layers are cut into ``pp`` stages:
    one, but for the input embedding of a model whose output head shares it (``tied``), which the first stage
    looks tokens up in and the last stage projects onto (both hold it, and sum its gradient:
    :mod:`loomrl.parallel.pipeline`)."""
    if num_layers < 1 or pp < 1 or num_layers % pp:
        raise ValueError(f"pp={pp} does not divide num_layers={num_layers}")
    match = _LAYER.search(param_name)
    if match is not None:
        layer = int(match.group(1))
        if layer >= num_layers:
            raise ValueError(f"{param_name}: layer {layer} is beyond num_layers={num_layers}")
        return (layer // (num_layers // pp),)
    if "embed_tokens" in param_name.split("."):
        return (0, pp - 1) if tied and pp > 1 else (0,)
    return (pp - 1,)


def chunk(size: int, parts: int, index: int) -> Interval:
    """Block ``index`` of ``size`` items cut into ``parts`` like ``torch.chunk`` (possibly empty)."""
    step = -(-size // parts)
    return min(index * step, size), min((index + 1) * step, size)


def tp_intervals(shape: Sequence[int], dim: int | None, tp: int, tp_rank: int) -> list[Interval]:
    """Flat intervals of tensor-parallel block ``tp_rank`` of a tensor of ``shape`` split along ``dim``."""
    numel = math.prod(shape)
    if dim is None or tp == 1:
        return [(0, numel)] if numel else []
    if dim >= len(shape):
        raise ValueError(f"cannot split a tensor of shape {tuple(shape)} along dim {dim}")
    start, end = chunk(shape[dim], tp, tp_rank)
    inner = math.prod(shape[dim + 1 :])  # elements per index of the split dim
    outer = math.prod(shape[:dim])  # one interval per index of the dims before it (merged when adjacent)
    stride = shape[dim] * inner
    if start == end:
        return []
    if start == 0 and end == shape[dim]:
        return [(0, numel)] if numel else []
    return [(o * stride + start * inner, o * stride + end * inner) for o in range(outer) if inner]


def slice_intervals(intervals: Sequence[Interval], start: int, end: int) -> list[Interval]:
    """The part of ``intervals`` at positions ``[start, end)`` of their concatenation."""
    out: list[Interval] = []
    offset = 0
    for lo, hi in intervals:
        length = hi - lo
        a, b = max(start, offset), min(end, offset + length)
        if a < b:
            out.append((lo + a - offset, lo + b - offset))
        offset += length
        if offset >= end:
            break
    return out


SPLITS = ("none", "rows", "flat")
"""How data-parallel ranks divide a (pp, tp) shard (module docstring)."""


def shard_intervals(
    param_name: str,
    shape: Sequence[int],
    layout: Layout,
    rank: int,
    num_layers: int,
    split: str = "none",
    tied: bool = False,
) -> list[Interval]:
    """Sorted, disjoint, non-adjacent flat intervals of the full parameter that ``rank`` of ``layout`` holds,
    its data-parallel ranks dividing each (pp, tp) shard as ``split`` says (``tied``: see :func:`pp_stages`)."""
    pp_rank, dp_rank, tp_rank = layout.coords(rank)
    if pp_rank not in pp_stages(param_name, num_layers, layout.pp, tied):
        return []
    dim = tp_dim(param_name)
    intervals = tp_intervals(shape, dim, layout.tp, tp_rank)
    if split == "none" or layout.dp == 1:
        return intervals
    local = _local_shape(shape, dim, layout.tp, tp_rank)
    if split == "rows":  # rows [a, b) of the local tensor: elements [a·row, b·row) of its flat form
        row = math.prod(local[1:])
        start, end = chunk(local[0], layout.dp, dp_rank)
        return slice_intervals(intervals, start * row, end * row)
    if split == "flat":
        return slice_intervals(intervals, *chunk(math.prod(local), layout.dp, dp_rank))
    raise ValueError(f"split {split!r}; valid: {', '.join(SPLITS)}")


def _local_shape(shape: Sequence[int], dim: int | None, tp: int, tp_rank: int) -> tuple[int, ...]:
    """Shape of tensor-parallel block ``tp_rank`` of a tensor of ``shape`` split along ``dim``."""
    if dim is None or tp == 1:
        return tuple(shape)
    start, end = chunk(shape[dim], tp, tp_rank)
    return (*shape[:dim], end - start, *shape[dim + 1 :])


def interval_table(intervals: Sequence[Interval]) -> tuple[list[int], list[int]]:
    """Where each of a shard's intervals starts in the flat index space and in the shard (the intervals'
    concatenation): bisect the first list for a flat index, add the second for its place in the shard."""
    starts, offsets, at = [], [], 0
    for lo, hi in intervals:
        starts.append(lo)
        offsets.append(at)
        at += hi - lo
    return starts, offsets


def shard_numel(intervals: Sequence[Interval]) -> int:
    """Elements held over ``intervals``."""
    return sum(hi - lo for lo, hi in intervals)


def shard_shape(
    param_name: str,
    shape: Sequence[int],
    layout: Layout,
    rank: int,
    num_layers: int,
    split: str = "none",
    tied: bool = False,
) -> tuple[int, ...] | None:
    """Shape of the local tensor ``rank`` holds, its data-parallel ranks dividing each (pp, tp) shard as
    ``split`` says (``"rows"``: dim 0 divided; ``"flat"``: a 1-D block of the flattened shard), or None when the
    param is on another stage (``tied``: see :func:`pp_stages`)."""
    pp_rank, dp_rank, tp_rank = layout.coords(rank)
    if pp_rank not in pp_stages(param_name, num_layers, layout.pp, tied):
        return None
    local = _local_shape(shape, tp_dim(param_name), layout.tp, tp_rank)
    if split == "none" or layout.dp == 1:
        return local
    if split == "rows":
        start, end = chunk(local[0], layout.dp, dp_rank)
        return (end - start, *local[1:])
    if split == "flat":
        start, end = chunk(math.prod(local), layout.dp, dp_rank)
        return (end - start,)
    raise ValueError(f"split {split!r}; valid: {', '.join(SPLITS)}")
