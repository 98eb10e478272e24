"""loomrl.data: synthetic tasks, index-addressed prompt sources, reward functions and preference pairs."""

from loomrl.data.preferences import preference_pairs
from loomrl.data.prompts import (
    SPLITS,
    FilePrompts,
    FunctionTask,
    PromptSource,
    RewardFn,
    SyntheticPrompts,
    stable_hash,
)
from loomrl.data.reward_functions import load_reward_fn
from loomrl.data.tasks import (
    TASKS,
    AddNumbers,
    Example,
    ReverseWord,
    SortDigits,
    Task,
    make_task,
    partial_credit,
)

__all__ = [
    "SPLITS",
    "TASKS",
    "AddNumbers",
    "Example",
    "FilePrompts",
    "FunctionTask",
    "PromptSource",
    "ReverseWord",
    "RewardFn",
    "SortDigits",
    "SyntheticPrompts",
    "Task",
    "load_reward_fn",
    "make_task",
    "partial_credit",
    "preference_pairs",
    "stable_hash",
]
