"""Configuration of a run's task: its prompts (synthetic or a file), its reward functions, its tokenizer and chat
template (``task`` in every command's config)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from loomrl.config.tools import FieldError, ValidatedConfig, fail, spec

TASK_NAMES = ("sort", "add", "reverse", "arith", "judge", "file")
JUDGED_TASKS = ("sort", "add", "reverse")


@dataclass(frozen=True)
class TaskConfig(ValidatedConfig):
    name: str = spec("sort", choices=TASK_NAMES)
    """Synthetic task (sort, add, reverse; arith: arithmetic questions in words for chat models, rewarded by the
    response's last number), 'judge' (verdicts yes/no on responses to task judged, right half of the
    time: what a generative reward model is trained on, loomrl.data.judges) or 'file' for a user prompt file with
    a reward function."""
    judged: str = spec("sort", choices=JUDGED_TASKS)
    """Task 'judge': the task whose responses are judged (its options min_len, max_len, max_digits apply)."""
    min_len: int = spec(3, ge=1, le=32)
    """Shortest input (digits to sort, letters to reverse)."""
    max_len: int = spec(5, ge=1, le=32)
    """Longest input (digits to sort, letters to reverse)."""
    max_digits: int = spec(3, ge=1, le=12)
    """Largest operand size of the 'add' task, in digits."""
    level: int = spec(1, ge=1, le=4)
    """Difficulty of the 'arith' task: 1, a two-digit number plus a one-digit one; 2, ± of two two-digit numbers;
    3, + - × of up to three digits; 4, two-step word problems."""
    prompt_file: str | None = None
    """JSONL or parquet file of prompts (task 'file'), one row per prompt."""
    eval_file: str | None = None
    """JSONL or parquet file of held-out prompts for evaluation, with the columns of prompt_file; None evaluates
    a synthetic task on its own eval stream, and task 'file' on prompt_file itself."""
    prompt_key: str = "prompt"
    """Column of the prompt files holding each prompt: text, or a chat conversation so far (a list of
    {role, content} messages, e.g. a 'messages' column; a final assistant turn becomes the answer)."""
    answer_key: str = "answer"
    """Column of the prompt files holding the reference answer (optional in the file)."""
    reward_fn: str | None = None
    """Reward function of task 'file' as 'module:function' or 'file.py:function', in one of three forms read from
    its signature: loomrl's fn(prompt, response, answer) -> float (prompt is the text, or a chat row's last user
    message); TRL's f(prompts, completions, **columns) -> list[float], a batch per call, the prompt file's other
    columns as lists by name; verl's compute_score(data_source, solution_str, ground_truth, extra_info) -> float or
    a dict with a 'score'. Any finite number is a reward."""
    reward_fns: tuple[str, ...] = ()
    """Several reward functions of task 'file' (each as reward_fn says), instead of reward_fn: the reward is their
    weighted sum, and each one's mean goes to the metrics as reward/<function> (a name that repeats gets its
    position in this list appended)."""
    reward_weights: tuple[float, ...] = ()
    """Weight of each of reward_fns, in their order (any sign); empty weighs every function 1.0."""
    reward_timeout_s: float = spec(30.0, ge=0)
    """Longest one call of a reward function may take, in seconds (one sample, or one batch for TRL's form): the
    function then runs in a process of its own, killed past this, and the run stops with an error naming the
    function and the sample (so does an exception). 0 calls it in the run's own process, without a limit."""
    tokenizer: str = "auto"
    """'auto': the tokenizer saved with the model checkpoint (the built-in task tokenizer for a zoo model);
    'task': the built-in character tokenizer; or the directory of a saved tokenizer."""
    chat_template: str = "auto"
    """'auto': prompts go through the tokenizer's chat template when it has one; 'none': never (bos, when the
    tokenizer has one, then the text); or a Jinja chat template file to apply instead."""

    @property
    def reward_functions(self) -> tuple[str, ...]:
        """The task's reward functions: reward_fns, or reward_fn alone."""
        return self.reward_fns or ((self.reward_fn,) if self.reward_fn is not None else ())

    def validate(self) -> None:
        if self.min_len > self.max_len:
            fail("min_len", f"{self.min_len} is greater than max_len {self.max_len}")
        if self.reward_fn is not None and self.reward_fns:
            fail("reward_fns", "give either reward_fn (one function) or reward_fns (several), not both")
        if self.reward_weights and len(self.reward_weights) != len(self.reward_fns):
            fail(
                "reward_weights",
                f"{len(self.reward_weights)} weights for {len(self.reward_fns)} functions of "
                "reward_fns (valid: one weight per function, or none for 1.0 each)",
            )
        if not all(math.isfinite(w) for w in self.reward_weights):
            fail("reward_weights", f"{list(self.reward_weights)} holds a weight that is not finite")
        if self.name == "file" and self.prompt_file is None:
            fail("prompt_file", "task 'file' needs a prompt_file")

    def check_rewarded(self, environment: bool | None = None) -> None:
        """A prompt file's rows need reward functions to be scored by (``reward_fn`` or ``reward_fns``), unless an
        environment rewards its episodes (``environment``: whether a training run has one, ``rollout.env.name``;
        None for the commands that have none)."""
        if self.name == "file" and not self.reward_functions and not environment:
            valid = " or an environment (rollout.env.name)" if environment is not None else ""
            try:
                fail("reward_fn", f"task 'file' needs reward_fn (or reward_fns){valid} to score its rows")
            except FieldError as err:
                raise err.under("task") from None
        if not self.tokenizer.strip():
            fail("tokenizer", "'' is empty; give auto, task or a tokenizer directory")
        if not self.chat_template.strip():
            fail("chat_template", "'' is empty; give auto, none or a Jinja template file")
