"""`loomrl rm`: a Bradley–Terry reward model trained on preference pairs ranked by the task's rule.

The model is an HF sequence-classification model (one output) scoring prompt + response + eos at its last
token; it starts from a zoo config or a checkpoint (an SFT policy gives it a head start). Reports held-out
pair accuracy and saves an HF checkpoint that the RL ``reward`` role loads.

Run:  loomrl rm examples/rm_sort.yaml model=runs/demo/sft
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from loomrl.algorithms.losses import bradley_terry_loss
from loomrl.algorithms.lr import learning_rate, set_lr
from loomrl.config.schema import RMConfig
from loomrl.data.preferences import preference_pairs
from loomrl.data.sources import build_task
from loomrl.models.heads import sequence_scores
from loomrl.models.tokenizer import encode_prompt, task_tokenizer
from loomrl.models.zoo import build_value_model
from loomrl.role import adamw, resolve_device, resolve_dtype
from loomrl.train.progress import RunProgress
from loomrl.workflow.batch import pack_sequences


def pair_scores(model, tokenizer, pairs, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of (chosen, rejected) for each (prompt, chosen, rejected) pair, in one forward pass."""
    prompts = [encode_prompt(tokenizer, p) for p, _, _ in pairs]
    eos = tokenizer.eos_token_id
    responses = [tokenizer.encode(c, add_special_tokens=False) + [eos] for _, c, _ in pairs]
    responses += [tokenizer.encode(r, add_special_tokens=False) + [eos] for _, _, r in pairs]
    ids_BL, attn_BL, _ = pack_sequences(prompts + prompts, responses, tokenizer.pad_token_id, device)
    scores_B = sequence_scores(model, ids_BL, attn_BL)
    return scores_B[: len(pairs)], scores_B[len(pairs) :]


@torch.no_grad()
def pair_accuracy(model, tokenizer, pairs, device, batch_size: int = 256) -> float:
    model.eval()
    right = 0
    for start in range(0, len(pairs), batch_size):
        chosen, rejected = pair_scores(model, tokenizer, pairs[start : start + batch_size], device)
        right += int((chosen > rejected).sum())
    model.train()
    return right / len(pairs)


def run_rm(cfg: RMConfig, progress: bool = True) -> dict[str, float]:
    """Train, evaluate held-out pair accuracy and save; returns the summary."""
    t0 = time.perf_counter()
    device = resolve_device(cfg.device, "device")
    tokenizer = task_tokenizer(cfg.task, cfg.model)
    task = build_task(cfg.task)
    train = preference_pairs(task, cfg.train_pairs, cfg.seed)
    held_out = preference_pairs(task, cfg.eval_pairs, cfg.seed + 1_000_003)
    dtype = resolve_dtype(cfg.precision, device)
    model = build_value_model(cfg.model, tokenizer, cfg.seed).to(device, dtype).train()
    opt = adamw(model, cfg.optim)
    steps_per_epoch = (len(train) + cfg.batch_size - 1) // cfg.batch_size
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(cfg.seed)
    with (
        open(out / "rm_metrics.jsonl", "w") as log,
        RunProgress(cfg.epochs * steps_per_epoch, enabled=progress, description="rm") as bar,
    ):
        for epoch in range(cfg.epochs):
            order = list(range(len(train)))
            rng.shuffle(order)
            for i in range(steps_per_epoch):
                step = epoch * steps_per_epoch + i
                batch = [train[j] for j in order[i * cfg.batch_size : (i + 1) * cfg.batch_size]]
                loss, acc = bradley_terry_loss(*pair_scores(model, tokenizer, batch, device))
                set_lr(opt, learning_rate(cfg.optim, step, cfg.epochs * steps_per_epoch))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
                opt.step()
                log.write(json.dumps({"step": step, "loss": loss.item(), "accuracy": float(acc)}) + "\n")
                bar.update(step, {"loss": loss.item()})
    accuracy = pair_accuracy(model, tokenizer, held_out, device)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    summary = {"loss": loss.item(), "eval/pair_accuracy": accuracy, "seconds": time.perf_counter() - t0}
    (out / "rm_summary.json").write_text(json.dumps(summary, indent=2))
    return summary
