"""Length buckets: one micro-batch's rows run through the model in groups of similar length.

A micro-batch is right-padded to its longest row, and a forward (and its backward) costs every padded position:
with RL's heavy-tailed response lengths (most short, a few at the budget) most of a batch can be padding. The
rows are sorted by length and cut into a few equal-count groups, each run only up to its own longest row, and
the outputs are put back in row order at the batch's width; the loss is then computed once over them, as
before, so the step is the same step. The split is taken only where it saves enough padded positions to pay
for a forward more (:data:`MIN_SAVING`).

The groups are decided from the rows' lengths alone, so processes holding the same rows (tensor-parallel
shards) run the same forwards; a caller whose forwards are collective over ranks holding other rows (FSDP)
must not split.

Legend: B = rows, L = positions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loomrl.workflow.batch import row_ends

__all__ = ["MAX_BUCKETS", "MIN_SAVING", "bucketed_outputs", "length_buckets"]

MAX_BUCKETS = 4
"""Most groups a micro-batch is cut into."""
MIN_SAVING = 0.1
"""Fraction of the micro-batch's padded positions each further group must save to be worth its forward."""
MIN_ROWS = 8
"""Fewest rows in a group: below it a forward's fixed cost outweighs its positions."""


def length_buckets(lengths_B: torch.Tensor) -> list[torch.Tensor]:
    """Row indices of each group, shortest rows first: ``[all rows]`` when splitting does not pay.

    Among cuts of the sorted rows into at most :data:`MAX_BUCKETS` groups of at least :data:`MIN_ROWS` rows, the
    one of fewest padded positions, each group beyond the first charged :data:`MIN_SAVING` of the unsplit
    micro-batch's (a small dynamic program over the places where the length changes)."""
    rows = lengths_B.shape[0]
    order_B = torch.argsort(lengths_B, stable=True)
    sorted_B = lengths_B[order_B].tolist()
    whole = [torch.arange(rows, device=lengths_B.device)]
    if rows < 2 * MIN_ROWS or sorted_B[0] == sorted_B[-1]:
        return whole
    cuts = _best_cuts(sorted_B, MIN_SAVING * rows * sorted_B[-1])
    if len(cuts) == 2:
        return whole
    return [order_B[a:b] for a, b in zip(cuts, cuts[1:])]


def _best_cuts(sorted_B: list[int], charge: float) -> list[int]:
    """Group boundaries ``[0, ..., rows]`` minimising padded positions plus ``charge`` per extra group."""
    rows = len(sorted_B)
    bounds = [0, *(i for i in range(1, rows) if sorted_B[i] != sorted_B[i - 1]), rows]
    # best[k][j]: (padded positions, previous boundary index) of rows [0, bounds[j]) in k + 1 groups
    best = [{j: (bounds[j] * sorted_B[bounds[j] - 1], 0) for j in range(1, len(bounds))}]
    for _ in range(1, MAX_BUCKETS):
        layer = {}
        for j in range(1, len(bounds)):
            options = [
                (cost + (bounds[j] - bounds[i]) * sorted_B[bounds[j] - 1], i)
                for i, (cost, _) in best[-1].items()
                if bounds[j] - bounds[i] >= MIN_ROWS and bounds[i] >= MIN_ROWS
            ]
            if options:
                layer[j] = min(options)
        best.append(layer)
    end = len(bounds) - 1
    k = min((k for k in range(len(best)) if end in best[k]), key=lambda k: best[k][end][0] + charge * k)
    cuts = [end]
    for layer in reversed(best[1 : k + 1]):
        cuts.append(layer[cuts[-1]][1])
    return [0, *(bounds[j] for j in reversed(cuts))]


def bucketed_outputs(
    forward: Callable[..., torch.Tensor],
    ids_BL: torch.Tensor,
    attn_BL: torch.Tensor,
    split: bool = True,
    rows_B: tuple[torch.Tensor, ...] = (),
    width: int | None = None,
) -> torch.Tensor:
    """``forward(ids, attn, *rows)``'s per-position outputs for right-padded rows, at the rows' full width ``L``
    (or ``width`` columns, for a forward that gives outputs at columns of its own), each group of
    :func:`length_buckets` (one group without ``split``) computed only up to its longest row (zeros past it);
    ``rows_B`` are per-row tensors handed to ``forward`` with their group's rows."""
    width = ids_BL.shape[1] if width is None else width
    groups = length_buckets(row_ends(attn_BL)) if split and ids_BL.shape[1] else [None]
    if len(groups) == 1:
        return _widened(forward(*_trimmed(ids_BL, attn_BL), *rows_B), width)
    outs = [_widened(forward(*_trimmed(ids_BL[g], attn_BL[g]), *(x[g] for x in rows_B)), width) for g in groups]
    inverse_B = torch.argsort(torch.cat(groups))
    return torch.cat(outs)[inverse_B]


def _trimmed(ids_BL: torch.Tensor, attn_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows cut after their last attended column: the causal mask keeps every real position's output the
    same, and the padding past it is not computed."""
    attended = attn_BL.any(0).nonzero()
    width = int(attended.max()) + 1 if attended.numel() else 1
    return ids_BL[:, :width], attn_BL[:, :width]


def _widened(out: torch.Tensor, width: int) -> torch.Tensor:
    """Per-position outputs padded back with zeros to ``width`` positions (what the caller indexes)."""
    if out.shape[1] == width:
        return out
    full = out.new_zeros((out.shape[0], width, *out.shape[2:]))
    full[:, : out.shape[1]] = out
    return full
