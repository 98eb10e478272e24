"""One-call generation for callers that have a list of prompts: a thin wrapper over the rollout engine."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from loomrl.rollout.engine import Completion, Request, RolloutEngine
from loomrl.rollout.sampling import SamplingParams


def generate(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    keys_B: torch.Tensor,
    params: SamplingParams,
    eos_id: int | Sequence[int],
    pad_id: int,
    slots: int = 256,
) -> list[Completion]:
    """Sample a response for every prompt (row ``b`` draws from stream ``keys_B[b]``), in prompt order."""
    keys = keys_B.tolist()
    requests = [Request(b, list(p), keys[b]) for b, p in enumerate(prompts)]
    max_len = max(len(p) for p in prompts) + params.max_new_tokens
    engine = RolloutEngine(model, params, eos_id, pad_id, slots=min(slots, len(prompts)), max_len=max_len)
    return engine.generate(requests)
