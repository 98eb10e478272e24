"""Set-up shared by the SFT, reward-model and RL commands: devices, tokenizers, tasks, prompt encoding."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from loomrl.config import OptimConfig, TaskConfig
from loomrl.data.prompts import FilePrompts, FunctionTask, PromptSource, SyntheticPrompts, load_reward_fn
from loomrl.data.tasks import Example, Task, make_task
from loomrl.errors import ConfigError
from loomrl.models.tokenizer import build_char_tokenizer, load_tokenizer


def resolve_device(kind: str, field: str = "runtime.device") -> torch.device:
    """'auto' → the accelerator when one is present, else cpu; 'cuda' without one is a config error."""
    if kind == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{field}: 'cuda' requested but no CUDA device is available (valid here: auto, cpu)")
    return torch.device(kind)


def resolve_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The weights' dtype of ``runtime.precision`` on ``device``: 'auto' is bf16 on accelerators (what their
    matmul units and the planner's cost model assume), fp32 on CPU (where bf16 matmuls are emulated)."""
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]


def adamw(model: torch.nn.Module, optim: OptimConfig, zero_group=None):
    """AdamW over ``model``'s parameters; with ``zero_group`` (a data-parallel process group) its state is
    sharded over that group (ZeRO-1, :class:`loomrl.parallel.zero.ZeroAdamW`), with the same updates. 16-bit
    weights (``precision: bf16``) get fp32 master weights in the optimizer, sharded or not."""
    if zero_group is not None or any(p.dtype != torch.float32 for p in model.parameters() if p.requires_grad):
        from loomrl.parallel.zero import ZeroAdamW

        return ZeroAdamW(model.named_parameters(), zero_group, lr=optim.lr, betas=optim.betas,
                         weight_decay=optim.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)


def tokenizer_for(model: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer saved with a checkpoint directory, else the built-in task alphabet tokenizer."""
    if model and Path(model).is_dir() and (Path(model) / "tokenizer_config.json").exists():
        return load_tokenizer(model)
    return build_char_tokenizer()


def build_task(cfg: TaskConfig) -> Task:
    if cfg.name == "file":
        return FunctionTask(load_reward_fn(cfg.reward_fn))
    if cfg.name == "add":
        return make_task("add", max_digits=cfg.max_digits)
    return make_task(cfg.name, min_len=cfg.min_len, max_len=cfg.max_len)


def prompt_source(cfg: TaskConfig, task: Task, seed: int, split: str) -> PromptSource:
    """Deterministic prompts by index; a prompt file serves both splits (held-out data is the user's call)."""
    if cfg.name == "file":
        return FilePrompts(cfg.prompt_file, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key)
    return SyntheticPrompts(task, seed, split)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return [tokenizer.bos_token_id, *tokenizer.encode(text, add_special_tokens=False)]


def decode_response(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """Text of a response up to (not including) its eos."""
    eos = tokenizer.eos_token_id
    if eos in ids:
        ids = ids[: ids.index(eos)]
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


def examples_window(source: PromptSource, start: int, n: int) -> list[Example]:
    """``n`` examples from data position ``start``, wrapping around a finite source."""
    size = len(source)
    return [source[(start + i) % size] for i in range(n)]


def set_threads(threads: int) -> None:
    if threads > 0:
        torch.set_num_threads(threads)
