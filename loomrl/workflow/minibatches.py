"""Which samples each optimizer step of a train MFC uses, on every data-parallel rank.

The schedule is a function of (seed, iteration, sample token counts, epochs, minibatches, dp) only, so the
single-process reference and any data-parallel layout take the same optimizer steps on the same samples.
Each step's minibatch is split over the DP ranks balanced by tokens; a rank weights its local mean loss by its
share of the minibatch's loss weight (:func:`loss_weights`: its tokens for a token-mean loss, its rows for a mean
over sequences), so the sum of the ranks' gradients is the reference's gradient.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loomrl.workflow.graph import LOSS_UNITS


def loss_weights(token_counts: Sequence[int], unit: str) -> list[int]:
    """Each row's weight in its minibatch's mean loss, from its token count: the count itself for ``token``, 1
    for ``sequence``. A micro-batch's or a rank's loss is weighted by its rows' share of the minibatch's sum."""
    if unit == "token":
        return list(token_counts)
    if unit == "sequence":
        return [1] * len(token_counts)
    raise ValueError(f"unknown loss unit {unit!r}; valid: {', '.join(LOSS_UNITS)}")


@dataclass(frozen=True)
class TrainStep:
    """One optimizer step: the rows (global batch positions) of each DP rank and the step's token total."""

    epoch: int
    rows_per_rank: tuple[tuple[int, ...], ...]
    tokens: int

    def local(self, dp_rank: int, token_counts: Sequence[int]) -> tuple[tuple[int, ...], float]:
        """This rank's rows and its loss weight (its share of the step's tokens)."""
        rows = self.rows_per_rank[dp_rank]
        return rows, sum(token_counts[r] for r in rows) / max(self.tokens, 1)


def _seed(seed: int, iteration: int, epoch: int) -> int:
    digest = hashlib.blake2b(f"minibatch/{seed}/{iteration}/{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def split_by_tokens(rows: Sequence[int], token_counts: Sequence[int], parts: int) -> tuple[tuple[int, ...], ...]:
    """Greedy longest-first assignment to the least-loaded part; each part keeps the original row order."""
    load = [0] * parts
    members: list[list[int]] = [[] for _ in range(parts)]
    for row in sorted(rows, key=lambda r: (-token_counts[r], r)):
        part = min(range(parts), key=lambda p: (load[p], len(members[p]), p))
        load[part] += token_counts[row]
        members[part].append(row)
    order = {row: i for i, row in enumerate(rows)}
    return tuple(tuple(sorted(m, key=order.__getitem__)) for m in members)


def minibatch_rows(n: int, epochs: int, minibatches: int, seed: int, iteration: int) -> list[tuple[int, list[int]]]:
    """``(epoch, rows)`` of every optimizer step over a batch of ``n`` rows: a seeded shuffle per epoch, cut into
    near-equal minibatches. Which rows train together depends on nothing else, so every executor and every
    data-parallel split of a minibatch trains on the same minibatches."""
    steps = []
    for epoch in range(epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(_seed(seed, iteration, epoch))).tolist()
        for part in torch.tensor_split(torch.tensor(order, dtype=torch.long), min(minibatches, n)):
            steps.append((epoch, part.tolist()))
    return steps


def minibatch_steps(
    token_counts: Sequence[int], epochs: int, minibatches: int, seed: int, iteration: int, dp: int = 1
) -> list[TrainStep]:
    """Every optimizer step of one train MFC (:func:`minibatch_rows`), each minibatch split over ``dp`` ranks."""
    return [
        TrainStep(epoch, split_by_tokens(rows, token_counts, dp), sum(token_counts[r] for r in rows))
        for epoch, rows in minibatch_rows(len(token_counts), epochs, minibatches, seed, iteration)
    ]
