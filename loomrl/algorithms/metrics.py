"""Per-iteration rollout metrics: a pure function of the iteration's batch, run wherever the batch lives."""

from __future__ import annotations

from typing import Callable

from loomrl.data.tasks import Task
from loomrl.rollout.backend import length_stats
from loomrl.workflow.batch import Batch


def rollout_metrics(batch: Batch, decode: Callable[[list[int]], str], task: Task) -> dict[str, float]:
    """Reward, exact match (by the task's rule), KL to the reference and response-length statistics."""
    texts = [decode(r) for r in batch["response_ids"]]
    exact = [task.exact(p, t, a) for p, t, a in zip(batch["prompt_text"], texts, batch["answer"])]
    lengths = length_stats(len(r) for r in batch["response_ids"])
    return {
        "reward/mean": float(batch["score"].mean()),
        "reward/exact_match": sum(exact) / len(exact),
        **({"kl/mean": float(batch["kl"].sum(-1).mean())} if "kl" in batch else {}),  # workflows without KL have none
        "response/length": lengths.mean,
        "response/length_p90": lengths.p90,
        "response/length_max": float(lengths.max),
        "prompt/length": sum(len(p) for p in batch["prompt_ids"]) / len(batch),  # for the planner's traces
    }
