"""Decode occupancy: how many samples are live at each decode step, and how much context they hold.

A generation replica decodes its share of the batch one token per step for every live sample. Occupancy is
piecewise constant in the step index ``t``, so it is returned as :class:`Segment` runs: over
``start ≤ t < end``, ``live`` samples decode and their contexts sum to ``ctx_base + live·t``. The cost model
sums per-step costs over a run in closed form, so pricing never loops over steps.

Three schedules:

- :func:`continuous_segments`: continuous batching with room for every sample. All start at step 0; a
  sample of response length L decodes during steps ``0 ≤ t < L``; live(t) = samples · P(R > t) with P read
  off the sampled lengths (fractional samples are fine).
- :func:`slot_segments`: continuous batching with a fixed number of slots (the rollout engine's): samples
  wait in line and take a slot as soon as one frees; their lengths are the sample's quantiles in a
  length-blind order (:func:`admission_order`).
- :func:`padded_segments`: static batching: every sample occupies its row until the longest finishes. The
  baseline continuous batching is compared with.
- :func:`round_segments`: synchronous requests: the samples arrive in batches of ``round_size`` (in admission
  order) and each batch decodes, by continuous batching within it, until its longest sample ends before the
  next batch is sent.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import NamedTuple

from loomrl.workflow.batch import padded_micro_batch_slices

__all__ = [
    "Segment",
    "admission_order",
    "continuous_segments",
    "decode_steps",
    "expected_longest",
    "live_context",
    "padded_segments",
    "peak_context",
    "peak_live",
    "round_segments",
    "share",
    "slot_segments",
    "steady_segments",
    "whole_share",
]


class Segment(NamedTuple):
    """Decode steps ``start ≤ t < end`` with ``live`` samples whose contexts sum to ``ctx_base + live·t``."""

    start: int
    end: int
    live: float
    ctx_base: float


def continuous_segments(lengths: Sequence[int], samples: float, prompt_len: float) -> list[Segment]:
    """Unlimited continuous batching of ``samples`` samples whose response lengths follow ``lengths``."""
    scale = samples / len(lengths)
    remaining = len(lengths)
    out, start = [], 0
    for length, count in sorted(Counter(lengths).items()):
        if length > start:
            live = scale * remaining
            out.append(Segment(start, length, live, live * prompt_len))  # every sample started at step 0
            start = length
        remaining -= count
    return out


def padded_segments(lengths: Sequence[int], samples: float, prompt_len: float) -> list[Segment]:
    """Static batching: all ``samples`` rows decode until the longest response ends."""
    return [Segment(0, max(lengths), samples, samples * prompt_len)]


def slot_segments(lengths: Sequence[int], samples: int, slots: int, prompt_len: float) -> list[Segment]:
    """Continuous batching of ``samples`` samples through ``slots`` slots, admitted in order."""
    if samples <= slots:
        return continuous_segments(lengths, samples, prompt_len)
    free_at = [0] * slots  # heap of the steps at which each slot frees
    delta_live: dict[int, int] = Counter()
    delta_base: dict[int, float] = defaultdict(float)
    for length in admission_order(lengths, samples):
        start = heapq.heappop(free_at)
        end = start + length
        heapq.heappush(free_at, end)
        # a sample started at s has context prompt + (t − s) at step t: base prompt − s, slope 1
        delta_live[start] += 1
        delta_live[end] -= 1
        delta_base[start] += prompt_len - start
        delta_base[end] -= prompt_len - start
    out, live, base = [], 0, 0.0
    points = sorted(set(delta_live) | set(delta_base))
    for point, following in zip(points, points[1:]):
        live += delta_live.get(point, 0)
        base += delta_base.get(point, 0.0)
        if live > 0:
            out.append(Segment(point, following, float(live), base))
    return out


def round_segments(
    lengths: Sequence[int], samples: int, round_size: int, prompt_len: float, slots: int | None = None
) -> list[Segment]:
    """``samples`` samples sent ``round_size`` at a time (module docstring), each batch decoding through at most
    ``slots`` slots (all of it when None); a batch starts when the previous one has ended."""
    order = admission_order(lengths, samples)
    out: list[Segment] = []
    offset = 0
    for first in range(0, samples, round_size):
        batch = order[first : first + round_size]
        inner = (
            slot_segments(batch, len(batch), slots, prompt_len)
            if slots and len(batch) > slots
            else continuous_segments(batch, len(batch), prompt_len)
        )
        # shifted by ``offset`` steps: a sample's context at step t is what it was at step t − offset
        out += [Segment(g.start + offset, g.end + offset, g.live, g.ctx_base - g.live * offset) for g in inner]
        offset = decode_steps(out)
    return out


def steady_segments(lengths: Sequence[int], samples: float, live: float, prompt_len: float) -> list[Segment]:
    """Generation that never waits for a tail (partial rollouts: a weight update interrupts the samples in flight,
    which continue under the new weights): in the steady state ``live`` samples decode at every step, drawn from
    ``lengths``, and an iteration takes the steps that make ``samples`` samples' tokens. Every live sample holds
    the steady mean context (:func:`live_context`); a segment's contexts grow by one token a step, so the steps
    are cut into short segments each centred on that mean."""
    tokens = samples * sum(lengths) / len(lengths)
    steps = max(1, math.ceil(tokens / live))
    held = live * live_context(lengths, prompt_len)
    width = max(1, math.ceil(steps / STEADY_SEGMENTS))
    out = []
    for start in range(0, steps, width):
        end = min(steps, start + width)
        out.append(Segment(start, end, live, held - live * (start + end - 1) / 2))
    return out


def partial_pieces(lengths: Sequence[int], max_staleness: int, segment: int | None) -> tuple[int, ...]:
    """What the rollout generate call of one iteration decodes under loomrl's partial rollouts
    (:class:`~loomrl.plan.plan.AsyncTraining`), in the steady state: of every sample length, one piece per
    iteration it is generated in: ``segment`` tokens in each but its last (None: the longest length over
    ``max_staleness``, rounded up, as the runtime divides the response budget), the rest in the last. Each
    iteration's call holds one batch's worth of them, the first piece of the newest batch beside the later pieces
    of older ones, all decoding together."""
    step = segment or max(1, -(-max(lengths, default=1) // max_staleness))
    out: list[int] = []
    for n in lengths:
        cuts = [min(step, n - k * step) for k in range(max_staleness - 1)]
        out += [c for c in cuts if c > 0]
        rest = n - (max_staleness - 1) * step
        if rest > 0:
            out.append(rest)
    return tuple(out)


STEADY_SEGMENTS = 32
"""Segments :func:`steady_segments` cuts its steps into (each's contexts within half its width of the mean)."""


def live_context(lengths: Sequence[int], prompt_len: float) -> float:
    """Mean context of a sample while it decodes, over the steps it is live: the prompt plus half its response,
    weighted by how long it stays (``E[L²] / 2E[L]``; long samples are live longer, so they weigh more). What a
    KV cache of a given size must hold per sample in the steady state of continuous batching."""
    total = sum(lengths)
    return prompt_len + (sum(n * n for n in lengths) / (2 * total) if total else 0.0)


def expected_longest(lengths: Sequence[int], k: float) -> float:
    """Expected longest of ``k`` samples drawn from ``lengths`` (with replacement): the i-th smallest of n is
    the longest with probability (i/n)^k − ((i−1)/n)^k. What a padded micro-batch of k samples is as long as."""
    ordered = sorted(lengths)
    n = len(ordered)
    return sum(x * (((i + 1) / n) ** k - (i / n) ** k) for i, x in enumerate(ordered))


def sorted_longest(lengths: Sequence[int], groups: int, least_padding: bool = False) -> tuple[float, float]:
    """Mean and mean square, over the samples, of the longest of their group when ``lengths`` are sorted and cut
    into ``groups`` contiguous groups (a sample of a micro-batch padded to its own longest): near-equal groups,
    or with ``least_padding`` where they pad least (:func:`~loomrl.workflow.batch.padded_micro_batch_slices`, as
    the runtime cuts them off pipelines)."""
    ordered = sorted(lengths)
    n, groups = len(ordered), max(1, min(int(groups), len(ordered)))
    if least_padding and n:
        cuts = padded_micro_batch_slices(ordered, groups)
        tops = [(ordered[c.stop - 1], c.stop - c.start) for c in cuts]
        return sum(x * k for x, k in tops) / n, sum(x * x * k for x, k in tops) / n
    bounds = [round(j * n / groups) for j in range(groups + 1)]
    tops = [(ordered[hi - 1], hi - lo) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
    return sum(x * k for x, k in tops) / n, sum(x * x * k for x, k in tops) / n


def admission_order(lengths: Sequence[int], samples: int) -> list[int]:
    """``samples`` lengths drawn evenly from the quantiles of ``lengths``, in an order blind to length.

    Quantile ``(i + 0.5) / samples`` of the sorted sample gives sample i's length; the order is the
    golden-ratio sequence over them (rank ``frac(i·φ)``), which interleaves short and long evenly the way a
    random arrival order does on average, without a random state and whatever order ``lengths`` came in.
    """
    ordered = sorted(lengths)
    picked = [ordered[min(len(ordered) - 1, int((i + 0.5) * len(ordered) / samples))] for i in range(samples)]
    golden = (math.sqrt(5) - 1) / 2
    return [picked[i] for i in sorted(range(samples), key=lambda i: (i * golden) % 1.0)]


def peak_context(segments: Sequence[Segment]) -> float:
    """Largest total context held at any step: what a paged KV cache must hold at its fullest."""
    return max((s.ctx_base + s.live * (s.end - 1) for s in segments), default=0.0)


def decode_steps(segments: Sequence[Segment]) -> int:
    """Steps until the last sample finishes."""
    return max((s.end for s in segments), default=0)


def peak_live(segments: Sequence[Segment]) -> float:
    """Most samples decoding at once."""
    return max((s.live for s in segments), default=0.0)


def share(batch: float, dp: int) -> float:
    """Samples of one data-parallel replica (the controller balances them; fractional on average)."""
    return batch / dp


def whole_share(batch: float, dp: int) -> int:
    """The largest replica's sample count when samples are whole."""
    return math.ceil(batch / dp)
