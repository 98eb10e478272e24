"""The task and the prompts a run's ``task`` settings name, addressed by data position."""

from __future__ import annotations

import dataclasses

from loomrl.config.schema import TaskConfig
from loomrl.data.arith import Arithmetic
from loomrl.data.prompts import FilePrompts, FunctionTask, PromptSource, SyntheticPrompts
from loomrl.data.tasks import EnvironmentScored, Example, Task, make_task

__all__ = ["build_task", "examples_window", "held_out", "prompt_source"]


def build_task(cfg: TaskConfig) -> Task:
    """The task (its scoring rule) of the ``task`` settings: a built-in one, or the user's reward functions."""
    if cfg.name == "file" and not cfg.reward_functions:  # an environment rewards the episodes
        return EnvironmentScored()
    if cfg.name == "file":
        return FunctionTask(
            cfg.reward_functions, name=cfg.name, timeout_s=cfg.reward_timeout_s, weights=cfg.reward_weights or None
        )
    if cfg.name == "judge":
        from loomrl.data.judges import JudgeTask

        return JudgeTask(build_task(dataclasses.replace(cfg, name=cfg.judged)))
    if cfg.name == "arith":
        return Arithmetic(level=cfg.level)
    if cfg.name == "add":
        return make_task("add", max_digits=cfg.max_digits)
    return make_task(cfg.name, min_len=cfg.min_len, max_len=cfg.max_len)


def prompt_source(cfg: TaskConfig, task: Task, seed: int, split: str) -> PromptSource:
    """Deterministic prompts by index: ``task.eval_file`` for evaluation when given, else the prompt file (task
    'file', both splits) or the synthetic task's stream of that split."""
    if split != "train" and cfg.eval_file is not None:
        return FilePrompts(cfg.eval_file, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key)
    if cfg.name == "file":
        return FilePrompts(cfg.prompt_file, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key)
    return SyntheticPrompts(task, seed, split)


def held_out(cfg: TaskConfig, task: Task, seed: int, n: int) -> list[Example]:
    """The evaluation prompts: the first ``n`` of the eval source, and no more than a file holds (a row counted
    twice would weigh twice in the accuracy)."""
    source = prompt_source(cfg, task, seed, "eval")
    return examples_window(source, 0, min(n, len(source)))


def examples_window(source: PromptSource, start: int, n: int) -> list[Example]:
    """``n`` examples from data position ``start``, wrapping around a finite source."""
    size = len(source)
    return [source[(start + i) % size] for i in range(n)]
