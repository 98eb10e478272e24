"""The training-inference mismatch: how far the rollout engine's log-probs of the tokens it sampled (``logp``, the
behaviour policy's) are from the trainer's own under the same weights.

Whatever generates (loomrl's rollout engine, another inference engine), its numerics differ from the training
forward's (kernels, precisions, batch shapes), so the samples are slightly off-policy even in a synchronous run.
Four figures over the response tokens, with ``d = trainer - behaviour`` per token and ``w = exp(d)``:

- ``mismatch/mean_abs_logp_diff``: mean ``|d|``;
- ``mismatch/token_mult_prob_error``: mean ``exp(|d|)`` (NeMo RL's; 1 where they agree);
- ``mismatch/k3_kl``: mean ``w - 1 - d``, the k3 estimate of KL(behaviour || trainer);
- ``mismatch/ess``: ``(sum w)^2 / (n sum w^2)``, the importance weights' normalised effective sample size (1 where
  they agree);

and ``mismatch/tokens``, how many tokens they are over. They are means and a ratio of sums, so the ops report the
sums (:func:`mismatch_sums`), which add up exactly over micro-batches, data-parallel ranks and controllers, and the
trainer turns the iteration's totals into the figures (:func:`mismatch_metrics`).

Where the trainer's log-probs come from (:func:`loomrl.algorithms.workflows.actor_train_op`): the trainer's
recomputation ``old_logp`` where the workflow has one (an ``actor_inf`` call: top-k/top-p, ``recompute_logprobs``,
an off-policy correction), over every response of the batch. Otherwise the actor's first optimizer step: its
forward pass of the first minibatch runs under the weights that generated the batch (no update has happened yet
in a synchronous run), so it is the trainer's log-probs of that minibatch for free; the later minibatches' come
after an update and would mix learning into the figure, so only the first minibatch's responses are measured
(``mismatch/tokens`` says how many; with LoRA dropout, ``actor.lora.dropout`` > 0, that forward is noisy too, and
``algo.recompute_logprobs`` gives the clean figure for an extra forward pass). Under an asynchronous plan the
batch was sampled by older weights than either source, so the figures add the policy's drift since
(``async/staleness`` says how many versions).

Legend: B = samples, T = response tokens (right-padded).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["MISMATCH_SUMS", "mismatch_metrics", "mismatch_sums"]

_PREFIX = "mismatch/"
MISMATCH_SUMS = tuple(
    _PREFIX + name for name in ("tokens", "sum_abs_logp_diff", "sum_exp_abs_logp_diff", "sum_k3", "sum_w", "sum_w2")
)
"""The statistics an op reports (sums over the tokens it measured) and the trainer adds up over the iteration."""


@torch.no_grad()
def mismatch_sums(trainer_logp_BT: Tensor, behav_logp_BT: Tensor, mask_BT: Tensor) -> dict[str, float]:
    """Sums over the real tokens (``mask_BT``) of what :func:`mismatch_metrics` makes the figures of, in float64:
    the token count, ``|d|``, ``exp(|d|)``, ``w - 1 - d``, ``w`` and ``w^2`` for ``d = trainer - behav``,
    ``w = exp(d)``."""
    keep_BT = (mask_BT != 0).to(trainer_logp_BT.device)
    d_N = (trainer_logp_BT.double() - behav_logp_BT.to(trainer_logp_BT.device).double())[keep_BT]
    w_N = torch.exp(d_N)
    parts = (torch.ones_like(d_N), d_N.abs(), torch.exp(d_N.abs()), torch.expm1(d_N) - d_N, w_N, w_N.square())
    return {key: float(x.sum()) for key, x in zip(MISMATCH_SUMS, parts)}


def mismatch_metrics(stats: Mapping[str, float]) -> dict[str, float]:
    """``stats`` with the mismatch sums (:data:`MISMATCH_SUMS`, added up over the iteration) replaced by the figures
    (module docstring) and ``mismatch/tokens``; unchanged where it has none, and without figures over no tokens."""
    if MISMATCH_SUMS[-1] not in stats:
        return dict(stats)
    out = {k: v for k, v in stats.items() if k not in MISMATCH_SUMS}
    n, abs_d, exp_abs_d, k3, w, w2 = (float(stats[k]) for k in MISMATCH_SUMS)
    out[f"{_PREFIX}tokens"] = n
    if n > 0:
        out[f"{_PREFIX}mean_abs_logp_diff"] = abs_d / n
        out[f"{_PREFIX}token_mult_prob_error"] = exp_abs_d / n
        out[f"{_PREFIX}k3_kl"] = k3 / n
        out[f"{_PREFIX}ess"] = w * w / (n * w2)
    return out
