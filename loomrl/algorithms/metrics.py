"""Per-iteration rollout metrics: a pure function of the iteration's batch, run wherever the batch lives."""

from __future__ import annotations

from collections.abc import Callable

from loomrl.data.tasks import BatchScores, Task
from loomrl.rollout.backend import length_stats
from loomrl.workflow.batch import Batch


def rollout_metrics(batch: Batch, decode: Callable[[list[int]], str], task: Task) -> dict[str, float]:
    """Reward, exact match (by the task's rule), each reward function's mean (``reward/<function>``), KL to the
    reference, the overlong penalty (where the workflow shapes rewards) and response-length statistics."""
    texts = [decode(r) for r in batch["response_ids"]]
    rule = rule_scores(batch, texts, task)
    exact = rule.exact
    lengths = length_stats(sampled_lengths(batch))
    shaped = "overlong_penalty" in batch  # workflows with overlong reward shaping (algo.overlong_buffer)
    return {
        "reward/mean": float(batch["score"].mean()),
        "reward/exact_match": sum(exact) / len(exact),
        **{f"reward/{name}": mean for name, mean in part_means(rule.parts).items()},
        **({"kl/mean": float(batch["kl"].sum(-1).mean())} if "kl" in batch else {}),  # workflows without KL have none
        **({"reward/overlong_penalty": float(batch["overlong_penalty"].mean())} if shaped else {}),
        "response/length": lengths.mean,
        "response/length_p90": lengths.p90,
        "response/length_max": float(lengths.max),
        "prompt/length": sum(len(p) for p in batch["prompt_ids"]) / len(batch),  # for the planner's traces
        **({} if "episode_metrics" not in batch else episode_means(batch)),
        **{
            f"{key[: -len('_unreadable')]}/unreadable": float(batch[key].mean())  # judges' unreadable verdicts
            for key in batch.keys()
            if key.endswith("_unreadable")
        },
    }


def rule_scores(batch: Batch, texts: list[str], task: Task) -> BatchScores:
    """The task's rule on the batch: as the reward call computed it (its ``rule_scores`` column), else (a reward
    from a model alone) computed here."""
    if "rule_scores" in batch and all(s is not None for s in batch["rule_scores"]):
        return BatchScores.of_samples(batch["rule_scores"])
    rows = batch["row"] if "row" in batch else [{} for _ in texts]
    return task.score_batch(batch["prompt_text"], texts, batch["answer"], rows)


def sampled_lengths(batch: Batch) -> list[int]:
    """Each response's sampled tokens: its length, less a multi-turn episode's observation tokens (reported apart,
    as ``episode/observed_tokens``)."""
    if "episode_metrics" not in batch:
        return [len(r) for r in batch["response_ids"]]
    return [len(r) - int(m["observed_tokens"]) for r, m in zip(batch["response_ids"], batch["episode_metrics"])]


def episode_means(batch: Batch) -> dict[str, float]:
    """Multi-turn rollouts: per episode on average, its turns, observation tokens and each environment metric, and
    the share of episodes that ended each way (``episode/finish_<why>``), under ``episode/``."""
    metrics = batch["episode_metrics"]
    names = sorted({name for sample in metrics for name in sample})
    return {f"episode/{name}": sum(m.get(name, 0.0) for m in metrics) / len(metrics) for name in names}


def part_means(parts: list[dict[str, float]]) -> dict[str, float]:
    """Each named part's mean over the samples that have it."""
    values_of: dict[str, list[float]] = {}
    for sample in parts:
        for name, value in sample.items():
            values_of.setdefault(name, []).append(value)
    return {name: sum(values) / len(values) for name, values in values_of.items()}
