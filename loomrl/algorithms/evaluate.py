"""Greedy held-out evaluation of a policy by the task's rule (exact match and mean score)."""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from loomrl.data.tasks import Example, Task
from loomrl.rollout import SamplingParams, generate, stream_keys
from loomrl.models.tokenizer import decode_response, encode_prompt


@torch.no_grad()
def evaluate_policy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    examples: Sequence[Example],
    max_new_tokens: int,
    batch_size: int = 128,
) -> dict[str, float]:
    """Greedy responses to ``examples``; returns exact-match rate and mean rule score."""
    was_training = model.training
    model.eval()
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    exact, score = 0, 0.0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        prompts = [encode_prompt(tokenizer, ex.model_input) for ex in chunk]
        keys = stream_keys(0, 0, range(len(chunk)))  # unused by greedy decoding
        gens = generate(model, prompts, keys, params, tokenizer.eos_token_id, tokenizer.pad_token_id)
        for ex, gen in zip(chunk, gens):
            text = decode_response(tokenizer, gen.tokens)
            exact += int(task.exact(ex.prompt, text, ex.answer))
            score += task.score(ex.prompt, text, ex.answer)
    model.train(was_training)
    return {"exact_match": exact / len(examples), "score": score / len(examples)}
