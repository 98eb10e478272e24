"""`loomrl sft`: supervised fine-tuning of a policy on task demonstrations (the warm start of RL).

Each step takes ``batch_size`` demonstrations at the current data position; the loss is the mean negative
log-likelihood of the answer and its eos, not of the prompt. Ends with a greedy held-out evaluation and an HF
checkpoint (model + tokenizer) that ``AutoModelForCausalLM.from_pretrained`` loads.

Run:  loomrl sft examples/sft_sort.yaml steps=100
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from loomrl.algorithms.advantages import masked_mean
from loomrl.algorithms.episode_ops import demonstrations
from loomrl.algorithms.evaluate import evaluate_policy
from loomrl.algorithms.lr import learning_rate, set_lr
from loomrl.config.environment import EnvConfig
from loomrl.config.schema import SFTConfig
from loomrl.data.sources import build_task, examples_window, held_out, prompt_source
from loomrl.models.heads import token_logprobs
from loomrl.models.tokenizer import encode_prompt, task_tokenizer
from loomrl.models.zoo import build_causal_lm
from loomrl.role import adamw, resolve_device, resolve_dtype
from loomrl.train.progress import RunProgress
from loomrl.workflow.batch import pack_sequences, pad_right, response_columns, response_mask


def demonstration_loss(
    model, tokenizer, examples, task, device: torch.device, env: EnvConfig | None = None
) -> torch.Tensor:
    """Mean NLL of answer + eos tokens given the prompt; with an environment, of the turns of each example's
    multi-turn demonstration (:func:`~loomrl.algorithms.episode_ops.demonstrations`), observations excluded."""
    if env is not None and env.enabled:
        episodes = demonstrations(tokenizer, env, examples)
        prompts, targets = [ep.prompt for ep in episodes], [ep.tokens for ep in episodes]
        mask_BR = pad_right([ep.mask for ep in episodes]).to(device)
    else:
        prompts = [encode_prompt(tokenizer, ex.model_input) for ex in examples]
        targets = [
            tokenizer.encode(task.demonstration(ex), add_special_tokens=False) + [tokenizer.eos_token_id]
            for ex in examples
        ]
        mask_BR = response_mask(targets).to(device)
    ids_BL, attn_BL, plen_B = pack_sequences(prompts, targets, tokenizer.pad_token_id, device)
    logp_BR = response_columns(token_logprobs(model, ids_BL, attn_BL), plen_B, mask_BR.shape[1])
    return -masked_mean(logp_BR, mask_BR)


def run_sft(cfg: SFTConfig, progress: bool = True) -> dict[str, float]:
    """Train, evaluate and save; returns final loss, held-out exact match and score, and seconds."""
    t0 = time.perf_counter()
    device = resolve_device(cfg.device, "device")
    tokenizer = task_tokenizer(cfg.task, cfg.model)
    task = build_task(cfg.task)
    train = prompt_source(cfg.task, task, cfg.seed, "train")
    held = held_out(cfg.task, task, cfg.seed, cfg.eval_prompts)
    dtype = resolve_dtype(cfg.precision, device)
    model = build_causal_lm(cfg.model, tokenizer, cfg.seed).to(device, dtype).train()
    opt = adamw(model, cfg.optim)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with (
        open(out / "sft_metrics.jsonl", "w") as log,
        RunProgress(cfg.steps, enabled=progress, description="sft") as bar,
    ):
        for step in range(cfg.steps):
            examples = examples_window(train, step * cfg.batch_size, cfg.batch_size)
            loss = demonstration_loss(model, tokenizer, examples, task, device, cfg.env)
            set_lr(opt, learning_rate(cfg.optim, step, cfg.steps))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            opt.step()
            log.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
            bar.update(step, {"loss": loss.item()})
    result = evaluate_policy(model, tokenizer, task, held, cfg.max_new_tokens, env=cfg.env)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    summary = {"loss": loss.item(), **{f"eval/{k}": v for k, v in result.items()}, "seconds": time.perf_counter() - t0}
    (out / "sft_summary.json").write_text(json.dumps(summary, indent=2))
    return summary
