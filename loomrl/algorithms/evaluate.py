"""Evaluating a policy by the task's rule: greedy exact match and mean score, and pass@k from sampled responses.

pass@k is the chance that at least one of k responses to a prompt is exactly right. From n ≥ k samples of which c
are right, the unbiased estimator (Chen et al., 2021, "Evaluating Large Language Models Trained on Code") is

    pass@k = 1 − C(n − c, k) / C(n, k)

averaged over prompts; it equals 1 when fewer than k samples are wrong. Sample j of prompt i draws from the
random stream of sample id i·n + j, so a result does not depend on the batch size or the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from loomrl.algorithms.episode_ops import evaluate_episodes
from loomrl.config.environment import EnvConfig
from loomrl.data.tasks import BatchScores, Example, Task
from loomrl.models.tokenizer import decode_response, encode_prompt
from loomrl.rollout import SamplingParams, generate, generation_eos_ids, stream_keys


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased estimate of pass@k for one prompt from ``n`` samples of which ``correct`` were right."""
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k(n={n}, correct={correct}, k={k}): needs 0 <= correct <= n and 1 <= k <= n")
    if n - correct < k:
        return 1.0
    return 1.0 - comb(n - correct, k) / comb(n, k)


@torch.no_grad()
def _responses(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[int]],
    sample_ids: Sequence[int],
    params: SamplingParams,
    seed: int,
    batch_size: int,
) -> list[str]:
    """The decoded response to each prompt, sample ``sample_ids[b]`` drawing from its own stream."""
    texts: list[str] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        keys = stream_keys(seed, 0, sample_ids[start : start + batch_size])
        eos_ids = (tokenizer.eos_token_id, *generation_eos_ids(model))
        gens = generate(model, chunk, keys, params, eos_ids, tokenizer.pad_token_id)
        texts += [decode_response(tokenizer, gen.tokens) for gen in gens]
    return texts


def evaluate_policy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    examples: Sequence[Example],
    max_new_tokens: int,
    batch_size: int = 128,
    env: EnvConfig | None = None,
) -> dict[str, float]:
    """Greedy responses to ``examples``; returns exact-match rate and mean rule score. With an environment
    (``rollout.env``), greedy episodes instead (:func:`~loomrl.algorithms.episode_ops.evaluate_episodes`)."""
    if env is not None and env.enabled:
        return evaluate_episodes(model, tokenizer, env, examples, max_new_tokens)
    was_training = model.training
    model.eval()
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    prompts = [encode_prompt(tokenizer, ex.model_input) for ex in examples]
    texts = _responses(model, tokenizer, prompts, range(len(prompts)), params, 0, batch_size)  # greedy: no noise
    model.train(was_training)
    scores = _scores(task, examples, texts)
    return {"exact_match": sum(scores.exact) / len(examples), "score": sum(scores.total) / len(examples)}


def evaluate_pass_at_k(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    examples: Sequence[Example],
    params: SamplingParams,
    samples: int,
    ks: Sequence[int],
    seed: int,
    batch_size: int = 128,
) -> dict[str, float]:
    """``samples`` sampled responses per example: pass@k for each of ``ks`` (averaged over examples) and the
    mean rule score of the samples."""
    was_training = model.training
    model.eval()
    prompts = [encode_prompt(tokenizer, ex.model_input) for ex in examples]
    rows = [p for p in prompts for _ in range(samples)]
    texts = _responses(model, tokenizer, rows, range(len(rows)), params, seed, batch_size)
    model.train(was_training)
    scores = _scores(task, [ex for ex in examples for _ in range(samples)], texts)
    correct = [sum(scores.exact[i * samples : (i + 1) * samples]) for i in range(len(examples))]
    out = {f"pass@{k}": sum(pass_at_k(samples, c, k) for c in correct) / len(examples) for k in ks}
    out["sampled_score"] = sum(scores.total) / (len(examples) * samples)
    return out


def _scores(task: Task, examples: Sequence[Example], texts: Sequence[str]) -> BatchScores:
    """The task's rule on each example's response, in one batch (a batched reward function is called once)."""
    return task.score_batch(
        [ex.prompt for ex in examples], texts, [ex.answer for ex in examples], [ex.row for ex in examples]
    )
