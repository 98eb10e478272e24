"""`loomrl eval`: greedy accuracy and pass@k of a checkpoint on a prompt set, written as JSON.

The argument is a policy checkpoint (any HF causal-LM directory with its tokenizer), a checkpoint of a run
(``RUN/checkpoints/iter_N``, whose ``actor`` is evaluated) or a run directory (its latest checkpoint). A run's
own task settings and response budget are the defaults, so ``loomrl eval runs/grpo`` evaluates on the prompts
the run evaluated on (``task.eval_file``, a prompt file or the synthetic task's eval stream); ``key=value``
overrides change them (``task.eval_file=held_out.jsonl samples=16 pass_k=[1,16]``).

Run:  loomrl eval runs/grpo samples=8 pass_k=[1,4,8]
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loomrl.algorithms.evaluate import evaluate_pass_at_k, evaluate_policy
from loomrl.checkpoint.store import STATE_FILE, export_checkpoint, latest_checkpoint
from loomrl.config.schema import EvalConfig, TrainConfig
from loomrl.config.tools import load_config, to_dict
from loomrl.data.sources import build_task, held_out
from loomrl.errors import ConfigError, DataError
from loomrl.models.pretrained import is_pretrained, pretrained_dir
from loomrl.models.tokenizer import task_tokenizer
from loomrl.models.zoo import build_causal_lm
from loomrl.role import resolve_device, resolve_dtype
from loomrl.rollout import SamplingParams
from loomrl.run_dir import RunDir

RESULTS_FILE = "eval.json"


@dataclass(frozen=True)
class Target:
    """What ``loomrl eval`` was pointed at, resolved."""

    model: Path
    """The policy's checkpoint directory."""
    run: Path | None
    """The run it belongs to, whose config.yaml gives the defaults (None: a checkpoint on its own)."""
    out_dir: Path
    """Where eval.json goes by default: the run, or the checkpoint directory."""


def resolve_target(path: str | Path) -> Target:
    """A run directory → its latest checkpoint's actor; ``iter_N`` → its actor; a model directory → itself; a
    pretrained name → its converted checkpoint.
    A run's checkpoint has its actor's files checked against its manifest first; a sharded one's actor is
    exported to ``iter_N/hf/actor`` on first use (:func:`~loomrl.checkpoint.store.export_checkpoint`)."""
    if is_pretrained(str(path)):  # its converted checkpoint; eval.json goes to runs/NAME, not into the cache
        return Target(Path(pretrained_dir(str(path))), None, Path("runs") / str(path))
    path = Path(path)
    files = RunDir(path)
    if files.checkpoints.is_dir() or (files.config.is_file() and not (path / "config.json").is_file()):
        ckpt = latest_checkpoint(path)
        if ckpt is None:
            raise DataError(f"run '{path}': has no complete checkpoint to evaluate (checkpoints/iter_N/actor)")
        return Target(export_checkpoint(ckpt, "actor"), path, path)
    if (path / "actor" / "config.json").is_file():
        if (path / STATE_FILE).is_file():  # a run's checkpoint: its manifest covers the actor
            return Target(export_checkpoint(path, "actor"), _run_of(path), path)
        return Target(path / "actor", _run_of(path), path)
    if (path / "config.json").is_file():
        run = _run_of(path.parent) if path.name == "actor" else None
        return Target(path, run, path)
    raise DataError(
        f"'{path}': neither a run directory, a run's checkpoint nor a model checkpoint directory (one with config.json)"
    )


def _run_of(checkpoint: Path) -> Path | None:
    """The run holding ``RUN/checkpoints/iter_N`` (None if it is not one)."""
    run = checkpoint.parent.parent
    return run if checkpoint.parent == RunDir(run).checkpoints and RunDir(run).config.is_file() else None


def eval_config(target: Target, overrides: Sequence[str]) -> EvalConfig:
    """The command's settings: the run's task and response budget (if it is a run's), then the overrides."""
    base: dict[str, Any] = {"model": str(target.model)}
    if target.run is not None:
        run = load_config(TrainConfig, RunDir(target.run).config)
        base.update(task=to_dict(run.task), max_new_tokens=run.rollout.max_new_tokens, seed=run.seed)
    return load_config(EvalConfig, None, overrides, base=base)


def run_eval(cfg: EvalConfig, out_dir: Path) -> dict[str, Any]:
    """Evaluate ``cfg.model``; write the results as JSON (``cfg.out`` or OUT_DIR/eval.json) and return them."""
    t0 = time.perf_counter()
    device = resolve_device(cfg.device, "device")
    tokenizer = task_tokenizer(cfg.task, cfg.model)
    task = build_task(cfg.task)
    if cfg.prompts == 0 and cfg.task.eval_file is None and cfg.task.name != "file":
        raise ConfigError(
            "prompts: 0 means every prompt of a file, but this task's eval prompts are an endless "
            "synthetic stream; give a number of prompts, or task.eval_file"
        )
    examples = held_out(cfg.task, task, cfg.seed, cfg.prompts or sys.maxsize)
    model = build_causal_lm(cfg.model, tokenizer, cfg.seed).to(device, resolve_dtype(cfg.precision, device))
    greedy = evaluate_policy(model, tokenizer, task, examples, cfg.max_new_tokens, cfg.batch_size)
    results: dict[str, Any] = {
        "model": cfg.model,
        "prompts": len(examples),
        "samples": cfg.samples,
        "temperature": cfg.temperature,
        "max_new_tokens": cfg.max_new_tokens,
        "greedy/exact_match": greedy["exact_match"],
        "greedy/score": greedy["score"],
    }
    if cfg.samples:
        params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p)
        sampled = evaluate_pass_at_k(
            model, tokenizer, task, examples, params, cfg.samples, cfg.pass_k, cfg.seed, cfg.batch_size
        )
        results.update(sampled)
    results["seconds"] = time.perf_counter() - t0
    out = Path(cfg.out) if cfg.out else out_dir / RESULTS_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    results["written_to"] = str(out)
    return results
