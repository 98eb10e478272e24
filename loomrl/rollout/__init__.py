"""Rollout: sampling with per-sample random streams and KV-cached generation."""

from loomrl.rollout.sampling import SamplingParams, sample_tokens, stream_keys
from loomrl.rollout.generate import Generation, generate

__all__ = ["Generation", "SamplingParams", "generate", "sample_tokens", "stream_keys"]
