"""The interface every generation backend implements, and the length statistics the cost model consumes.

Callers (generate MFCs, streaming fusion, migration) talk to a :class:`GenerationBackend` only, so a vLLM or
SGLang adapter for GPU clusters can replace :class:`~loomrl.rollout.engine.RolloutEngine` without touching
them. A backend must honour per-sample random streams: a request's tokens depend only on its key, prompt and
prefix.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable

import torch

from loomrl.rollout.engine import Completion, Request


@runtime_checkable
class GenerationBackend(Protocol):
    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Run requests to completion; results in request order."""

    def stream(self, requests: Iterable[Request] = ()) -> Iterator[Completion]:
        """Submit requests and yield every sample (also earlier-submitted ones) as it finishes."""

    def abort(self, sample_ids: Iterable[int]) -> list[Completion]:
        """Stop samples and return their generated prefixes (finish_reason 'aborted')."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the model's weights (after a train step or a shadow-model sync)."""


@dataclass(frozen=True)
class LengthStats:
    """Distribution of generated lengths of one batch, in tokens."""

    count: int
    mean: float
    std: float
    p50: float
    p90: float
    p99: float
    max: int

    def as_dict(self, prefix: str = "response/") -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in asdict(self).items()}


def _quantile(sorted_lengths: Sequence[int], q: float) -> float:
    # Nearest-rank quantile: a real observed length, as the cost model's histogram buckets expect.
    rank = max(1, math.ceil(q * len(sorted_lengths)))
    return float(sorted_lengths[rank - 1])


def length_stats(lengths: Iterable[int]) -> LengthStats:
    values = sorted(int(x) for x in lengths)
    if not values:
        return LengthStats(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0)
    mean = sum(values) / len(values)
    var = sum((x - mean) ** 2 for x in values) / len(values)
    return LengthStats(
        len(values),
        mean,
        math.sqrt(var),
        _quantile(values, 0.5),
        _quantile(values, 0.9),
        _quantile(values, 0.99),
        values[-1],
    )
