"""What the pipeline tests (tests/test_pipeline.py, tests/test_pipeline_tp.py) share: a ragged batch, log-probs
from logits, a value model with a non-zero head, a model with tied embeddings, and the optimizer settings their
training steps use."""

from __future__ import annotations

import torch

from loomrl.models.heads import score_head
from loomrl.models.tokenizer import build_char_tokenizer
from loomrl.models.zoo import build_causal_lm, build_value_model

LR = 1e-3
MAX_NORM = 0.05
"""Small enough that the test gradients (norm ~1) are clipped."""

LENGTHS = (10, 7, 4, 9)
"""Right-padded rows of different lengths: 10, 7, 4 and 9 real tokens."""


def ragged_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of :data:`LENGTHS` rows, padding zeroed."""
    gen = torch.Generator().manual_seed(1)
    ids_BL = torch.randint(3, 48, (len(LENGTHS), max(LENGTHS)), generator=gen)
    mask_BL = (torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    return ids_BL.masked_fill(mask_BL == 0, 0), mask_BL


def logp_from_logits(logits_BLV: torch.Tensor, ids_BL: torch.Tensor) -> torch.Tensor:
    """What loomrl.models.heads.token_logprobs computes, from logits instead of a model (temperature 1)."""
    logits_BL1V = logits_BLV[:, :-1].float()
    picked_BL1 = logits_BL1V.gather(-1, ids_BL[:, 1:].unsqueeze(-1)).squeeze(-1)
    return picked_BL1 - torch.logsumexp(logits_BL1V, dim=-1)


def tied_model(name: str = "llama-1m") -> torch.nn.Module:
    """A zoo model (untied there) with its output head sharing its input embedding, as SmolLM2's and the small
    Qwen2.5 checkpoints have, config included."""
    model = build_causal_lm(name, build_char_tokenizer(), seed=0)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.get_input_embeddings().weight
    return model


def value_model() -> torch.nn.Module:
    """llama-1m as a value model whose score head is random (the zoo's starts at zero, which would make any
    comparison pass)."""
    model = build_value_model("llama-1m", build_char_tokenizer(), seed=0)
    with torch.no_grad():
        score_head(model).weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(3))
    return model


def adamw_steps(
    ref: torch.nn.Module, runner, pp_group, micro_batches: int = 2
) -> tuple[tuple[float, float], tuple[float, float]]:
    """One clipped AdamW step on the token-mean NLL of :func:`ragged_batch`: the unsplit model ``ref`` on the
    full batch, then the pipeline ``runner``'s stage over ``micro_batches``. Returns ((loss, norm) unsplit,
    (loss, norm) staged)."""
    from loomrl.models.heads import token_logprobs
    from loomrl.parallel.pipeline_runner import clip_grad_norm_pp
    from loomrl.workflow.batch import micro_batch_slices

    ids_BL, mask_BL = ragged_batch()
    total = int(mask_BL[:, 1:].sum())
    ref.train()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    ref_loss = -(token_logprobs(ref, ids_BL, mask_BL) * mask_BL[:, 1:]).sum() / total
    ref_loss.backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
    ref_opt.step()

    stage = runner.stage
    stage.model.train()
    opt = torch.optim.AdamW(stage.parameters(), lr=LR, weight_decay=0.1)
    rows = micro_batch_slices(len(LENGTHS), micro_batches)

    def loss_fn(logits_BLV: torch.Tensor, k: int) -> torch.Tensor:
        # Divided by the whole batch's token count, so the micro-batch losses sum to the full-batch loss.
        return -(logp_from_logits(logits_BLV, ids_BL[rows[k]]) * mask_BL[rows[k], 1:]).sum() / total

    loss = runner.train_step_backward(ids_BL, mask_BL, loss_fn, micro_batches=micro_batches, broadcast_result=True)
    runner.sum_tied_gradient()
    norm = clip_grad_norm_pp(stage, MAX_NORM, pp_group)
    opt.step()
    return (float(ref_loss), loss), (ref_norm, norm)


def values_diff(ref: torch.nn.Module, runner) -> float:
    """Largest difference between the unsplit value model ``ref`` and the pipeline ``runner`` (two
    micro-batches) over the real tokens of :func:`ragged_batch`."""
    from loomrl.models.heads import token_values

    ids_BL, mask_BL = ragged_batch()
    got = runner.forward(ids_BL, mask_BL, micro_batches=2, broadcast_result=True)
    with torch.no_grad():
        want = token_values(ref, ids_BL, mask_BL)
    assert want.abs().max() > 0.1 and got.shape == want.shape
    return (got - want)[mask_BL.bool()].abs().max().item()
