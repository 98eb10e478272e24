"""Rollout: the continuous-batching engine, per-sample random streams, and the backend interface."""

from loomrl.rollout.backend import GenerationBackend, LengthStats, length_stats
from loomrl.rollout.engine import Completion, Request, RolloutEngine, generation_eos_ids
from loomrl.rollout.generate import generate
from loomrl.rollout.sampling import SamplingParams, sample_tokens, stream_keys

__all__ = [
    "Completion",
    "GenerationBackend",
    "LengthStats",
    "Request",
    "RolloutEngine",
    "SamplingParams",
    "generate",
    "generation_eos_ids",
    "length_stats",
    "sample_tokens",
    "stream_keys",
]
