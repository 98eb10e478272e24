"""Which part of every parameter each rank of a layout holds, as intervals of the parameter's flat index space.

Pure Python (no torch): the reallocation planner, the cost model and tests use it without a process group.

The conventions, shared with :mod:`loomrl.parallel.tensor_parallel` and the execution plan:

- A layout ``Layout(dp, tp, pp)`` placed on a mesh (a tuple of global device ids) puts rank ``r`` on device
  ``mesh[r]``, with ``r = pp_rank * (dp * tp) + dp_rank * tp + tp_rank`` (tp fastest, then dp).
- Pipeline stages own contiguous, equal ranges of the decoder layers ``...layers.{i}.``; the input embedding
  lives on stage 0, everything else outside the layers (final norm, ``lm_head``, ``score``) on the last stage.
- Tensor parallelism splits q/k/v/gate/up projections column-wise (weight and bias along dim 0), o/down
  row-wise (weight along dim 1, bias replicated), ``embed_tokens`` and ``lm_head`` over the vocabulary
  (dim 0); everything else is replicated. A dim of size n is cut like ``torch.chunk`` (and DTensor's
  ``Shard``): blocks of ``ceil(n / tp)``, the last ones shorter or empty when tp does not divide n, which is
  equal blocks whenever it does.
- Both combine: a rank of a pp×tp layout holds its TP slice of the parameters of its stage only (as
  :func:`loomrl.parallel.pipeline.split_stages` followed by tensor parallelism leaves it).
- Data-parallel replicas hold full copies of their (tp, pp) shard; with ``fsdp=True`` each dp rank holds
  one ``torch.chunk``-style block of dim 0 of that shard instead, as FSDP2's ``fully_shard`` leaves it (its
  ``Shard(0)`` placement: whole rows, so a row-major local tensor is still a run of whole rows).

A rank's local tensor, flattened row-major, is the concatenation of the full parameter's flat elements over
its intervals in increasing order; that is what lets the executor pack and unpack pieces by offsets alone.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple, Sequence

from loomrl.plan.layout import Layout

Interval = tuple[int, int]
"""Half-open ``[start, end)`` range of a parameter's row-major flat index space."""

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Suffixes of the parameters tensor parallelism splits, and the dim it splits them along.
_COLUMN_WISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_WISE = ("o_proj", "down_proj")
_VOCAB = ("embed_tokens", "lm_head")


class Placement(NamedTuple):
    """A layout on a device mesh; a plain ``(mesh, layout)`` or ``(mesh, layout, fsdp)`` tuple also fits."""

    mesh: tuple[int, ...]
    """Global device id of every rank of the layout."""
    layout: Layout
    fsdp: bool = False
    """The dp ranks hold dim-0 blocks of their (tp, pp) shard, as FSDP2 shards them (a source layout only)."""


def as_placement(value: object, where: str) -> Placement:
    """Normalise ``value`` to a :class:`Placement` and check that the mesh fits the layout.

    ``value``: a Placement, a ``(mesh, layout[, fsdp])`` tuple, or any object with ``mesh`` and ``layout``
    attributes (and optionally ``fsdp``), such as :class:`loomrl.plan.Allocation`.
    """
    if isinstance(value, tuple):
        placement = Placement(tuple(value[0]), *value[1:])
    else:
        placement = Placement(tuple(value.mesh), value.layout, getattr(value, "fsdp", False))
    mesh, layout = placement.mesh, placement.layout
    if len(mesh) != layout.size:
        raise ValueError(f"{where}: dp={layout.dp} × tp={layout.tp} × pp={layout.pp} = {layout.size} ranks, "
                         f"but the mesh has {len(mesh)} devices")
    if len(set(mesh)) != len(mesh):
        raise ValueError(f"{where}: the mesh {mesh} names a device twice")
    return placement


def rank_coords(layout: Layout, rank: int) -> tuple[int, int, int]:
    """``(pp_rank, dp_rank, tp_rank)`` of ``rank``."""
    if not 0 <= rank < layout.size:
        raise ValueError(f"rank {rank} is outside a layout of {layout.size} ranks")
    pp_rank, rest = divmod(rank, layout.dp * layout.tp)
    dp_rank, tp_rank = divmod(rest, layout.tp)
    return pp_rank, dp_rank, tp_rank


def tp_dim(param_name: str) -> int | None:
    """The dim tensor parallelism splits ``param_name`` along, or None when it is replicated."""
    parts = param_name.split(".")
    if len(parts) < 2:
        return None
    module, kind = parts[-2], parts[-1]
    if module in _COLUMN_WISE or module in _VOCAB:
        return 0
    if module in _ROW_WISE and kind == "weight":
        return 1
    return None  # norms, score head, and row-wise biases (added after the all-reduce, so replicated)


def pp_stage(param_name: str, num_layers: int, pp: int) -> int:
    """The pipeline stage holding ``param_name`` when ``num_layers`` decoder layers are cut into ``pp`` stages."""
    if num_layers < 1 or pp < 1 or num_layers % pp:
        raise ValueError(f"pp={pp} does not divide num_layers={num_layers}")
    match = _LAYER.search(param_name)
    if match is not None:
        layer = int(match.group(1))
        if layer >= num_layers:
            raise ValueError(f"{param_name}: layer {layer} is beyond num_layers={num_layers}")
        return layer // (num_layers // pp)
    if "embed_tokens" in param_name.split("."):
        return 0
    return pp - 1


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
    inner = math.prod(shape[dim + 1:])  # elements per index of the split dim
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


def shard_intervals(param_name: str, shape: Sequence[int], layout: Layout, rank: int, num_layers: int,
                    fsdp: bool = False) -> list[Interval]:
    """Sorted, disjoint, non-adjacent flat intervals of the full parameter that ``rank`` of ``layout`` holds."""
    pp_rank, dp_rank, tp_rank = rank_coords(layout, rank)
    if pp_stage(param_name, num_layers, layout.pp) != pp_rank:
        return []
    dim = tp_dim(param_name)
    intervals = tp_intervals(shape, dim, layout.tp, tp_rank)
    if fsdp and layout.dp > 1:  # rows [a, b) of the local tensor: elements [a·row, b·row) of its flat form
        local = _local_shape(shape, dim, layout.tp, tp_rank)
        row = math.prod(local[1:])
        start, end = chunk(local[0], layout.dp, dp_rank)
        intervals = slice_intervals(intervals, start * row, end * row)
    return intervals


def _local_shape(shape: Sequence[int], dim: int | None, tp: int, tp_rank: int) -> tuple[int, ...]:
    """Shape of tensor-parallel block ``tp_rank`` of a tensor of ``shape`` split along ``dim``."""
    if dim is None or tp == 1:
        return tuple(shape)
    start, end = chunk(shape[dim], tp, tp_rank)
    return (*shape[:dim], end - start, *shape[dim + 1:])


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


def shard_shape(param_name: str, shape: Sequence[int], layout: Layout, rank: int, num_layers: int,
                fsdp: bool = False) -> tuple[int, ...] | None:
    """Shape of the local tensor ``rank`` holds, or None when the param is on another stage."""
    pp_rank, dp_rank, tp_rank = rank_coords(layout, rank)
    if pp_stage(param_name, num_layers, layout.pp) != pp_rank:
        return None
    local = _local_shape(shape, tp_dim(param_name), layout.tp, tp_rank)
    if fsdp and layout.dp > 1:
        start, end = chunk(local[0], layout.dp, dp_rank)
        return (end - start, *local[1:])
    return local
