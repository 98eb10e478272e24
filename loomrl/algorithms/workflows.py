"""Algorithms as workflows: each builder returns the MFC graph of one iteration.

The algorithms differ only in which MFCs they have and in the pure functions of
:mod:`loomrl.algorithms.advantages` and :mod:`loomrl.algorithms.losses` they bind; one training loop and any
executor run them all. Source keys (provided by the prompt batch): ``prompt_ids``, ``prompt_text``, ``answer``,
``row`` (the prompt file's other columns, for reward functions).

Departures from the papers, all standard in open-source RLHF: PPO, RLOO, ReMax and REINFORCE++ put the KL to
the reference in the reward (per token for PPO/REINFORCE++, summed per sequence for RLOO/ReMax); GRPO puts it
in the loss (k3 by default in the paper; the configured estimator here). The actor's objective (PPO's or GSPO's
clipped ratio), how its token losses are averaged (``algo.loss_agg``) and DAPO's overlong reward shaping
are settings of any algorithm, not algorithms of their own; DAPO is grpo with some of them
(``examples/dapo_sort.yaml``).

Legend: B = samples, R = response tokens (right-padded), G = samples per prompt.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch

from loomrl.algorithms import advantages as A
from loomrl.algorithms import losses as L
from loomrl.algorithms.context import OpContext
from loomrl.algorithms.episode_ops import EARNED, episodes_op
from loomrl.algorithms.mismatch import mismatch_sums
from loomrl.algorithms.ops import (
    generate_chunks,
    generate_op,
    judge_op,
    logprob_op,
    reward_op,
    train_loop,
    values_op,
    verdict_op,
)
from loomrl.config.schema import AlgoConfig, RewardConfig, RolloutConfig, judge_role
from loomrl.errors import ConfigError
from loomrl.models.heads import ENTROPY, LOGP
from loomrl.rollout import SamplingParams
from loomrl.workflow import MFC, MFCKind, Workflow
from loomrl.workflow.batch import Batch, pad_columns

SOURCE_KEYS = ("prompt_ids", "prompt_text", "answer", "row")


def _seq_kl(batch: Batch, kind: str) -> torch.Tensor:
    return L.kl_estimate(batch["logp"], batch["ref_logp"], kind) * batch["mask"]


def ppo_advantages(ctx: OpContext, batch: Batch, algo: AlgoConfig, kl_BR: torch.Tensor) -> dict:
    mask_BR = batch["mask"]
    reward_BR = A.token_rewards(batch["score"], kl_BR, mask_BR, algo.kl_coef, batch.get(EARNED))
    adv_BR, ret_BR = A.gae(reward_BR, batch["values"] * mask_BR, mask_BR, algo.gamma, algo.lam)
    if algo.whiten_advantages:
        adv_BR = A.masked_whiten(adv_BR, mask_BR, reduce=ctx.reduce) * mask_BR
    return {"advantages": adv_BR, "returns": ret_BR}


def grpo_advantages(ctx: OpContext, batch: Batch, algo: AlgoConfig, kl_BR: torch.Tensor) -> dict:
    adv_B = A.group_normalized(batch["score"], algo.group_size)
    if EARNED in batch:
        scale_B = A.group_scale(batch["score"], algo.group_size)
        return {"advantages": A.credit_by_turn(adv_B, batch["score"], batch[EARNED], batch["mask"], scale_B)}
    return {"advantages": A.broadcast_to_tokens(adv_B, batch["mask"])}


def rloo_advantages(ctx: OpContext, batch: Batch, algo: AlgoConfig, kl_BR: torch.Tensor) -> dict:
    adv_B = A.rloo_baseline(batch["score"] - algo.kl_coef * kl_BR.sum(-1), algo.group_size)
    if EARNED in batch:
        ones_B = torch.ones_like(adv_B)
        return {"advantages": A.credit_by_turn(adv_B, batch["score"], batch[EARNED], batch["mask"], ones_B)}
    return {"advantages": A.broadcast_to_tokens(adv_B, batch["mask"])}


def remax_advantages(ctx: OpContext, batch: Batch, algo: AlgoConfig, kl_BR: torch.Tensor) -> dict:
    adv_B = A.remax_advantage(batch["score"] - algo.kl_coef * kl_BR.sum(-1), batch["greedy_score"])
    return {"advantages": A.broadcast_to_tokens(adv_B, batch["mask"])}


def reinforce_pp_advantages(ctx: OpContext, batch: Batch, algo: AlgoConfig, kl_BR: torch.Tensor) -> dict:
    adv_BR = A.reinforce_pp_advantage(
        batch["score"], kl_BR, batch["mask"], algo.kl_coef, algo.gamma, reduce=ctx.reduce, earned_BT=batch.get(EARNED)
    )
    return {"advantages": adv_BR}


def _actor_loss(
    ctx: OpContext,
    mb: Batch,
    out_BR2: torch.Tensor,
    packed: tuple,
    algo: AlgoConfig,
    old_key: str,
    kl_in_loss: bool,
    first: _FirstStepMismatch | None = None,
):
    device = out_BR2.device
    mask_BR = mb["mask"].to(device)
    width = mask_BR.shape[1]
    logp_BR, ent_BR = pad_columns(out_BR2[..., LOGP], width), pad_columns(out_BR2[..., ENTROPY], width)
    adv_BR = mb["advantages"].to(device)
    old_BR = mb[old_key].to(device)
    if first is not None:  # old_BR is the sampler's log-probs here
        first.add(mb.ids, logp_BR.detach(), old_BR, mask_BR)
    weight_BR, off = None, {}
    if algo.off_policy != "none":  # the sampler's log-probs weigh each token; the ratio is clipped around old_BR
        weight_BR, off = L.behaviour_weights(
            old_BR, mb["logp"].to(device), mask_BR, algo.off_policy, algo.is_cap, algo.loss_agg, algo.is_low
        )
    loss, stats = L.policy_objective(algo.policy_loss)(
        logp_BR, old_BR, adv_BR, mask_BR, algo.clip_eps, algo.clip_eps_high, algo.loss_agg, weight_BR
    )
    stats = {f"actor/{k}": v for k, v in stats.items()} | {f"offpolicy/{k}": v for k, v in off.items()}
    stats["actor/pg_loss"] = loss.item()
    entropy = L.aggregate(ent_BR, mask_BR, algo.loss_agg)
    # the logged entropy is per token whatever the aggregation (a token sum per response is no entropy)
    stats["actor/entropy"] = L.token_stat(ent_BR.detach(), mask_BR, algo.loss_agg).item()
    if algo.entropy_coef > 0:
        loss = loss - algo.entropy_coef * entropy
    if kl_in_loss:
        kl = L.kl_penalty_loss(logp_BR, mb["ref_logp"].to(device), mask_BR, algo.kl_estimator, algo.loss_agg)
        stats["actor/kl_loss"] = kl.item()
        loss = loss + algo.kl_coef * kl
    return loss, stats


def _critic_loss(ctx: OpContext, mb: Batch, values_BR: torch.Tensor, packed: tuple, algo: AlgoConfig):
    device = values_BR.device
    mask_BR = mb["mask"].to(device)
    values_BR = pad_columns(values_BR, mask_BR.shape[1])
    loss, stats = L.value_loss(
        values_BR, mb["values"].to(device), mb["returns"].to(device), mask_BR, algo.value_clip_eps
    )
    return loss, {"critic/value_loss": loss.item(), **{f"critic/{k}": v for k, v in stats.items()}}


class _FirstStepMismatch:
    """The mismatch sums (:func:`~loomrl.algorithms.mismatch.mismatch_sums`) of the responses of the actor's first
    optimizer step, from the log-probs its forward computes before any update. The loss sees micro-batches in step
    order, so the first step's are the first ones whose rows are all among its rows and none seen before; the
    first micro-batch that is not ends the measure."""

    def __init__(self, ids: Iterable[int]):
        self.left = set(ids)
        self.open = True
        self.sums: dict[str, float] = {}

    def add(
        self, ids: Iterable[int], trainer_logp_BR: torch.Tensor, behav_logp_BR: torch.Tensor, mask_BR: torch.Tensor
    ) -> None:
        ids = set(ids)
        if not self.open or not ids <= self.left:
            self.open = False
            return
        self.left -= ids
        for key, value in mismatch_sums(trainer_logp_BR, behav_logp_BR, mask_BR).items():
            self.sums[key] = self.sums.get(key, 0.0) + value


def _recomputed_sums(ctx: OpContext, batch: Batch, algo: AlgoConfig) -> dict[str, float]:
    """Sums over this rank's rows of the first epoch (each of the batch's rows once over all ranks), which add up
    over ranks and controllers: the mismatch from the trainer's recomputed log-probs ``old_logp``, and under
    ``geo_reject`` the responses it leaves out (``offpolicy/responses_dropped``)."""
    per_epoch = len(ctx.train_steps) // max(algo.ppo_epochs, 1)
    rows = sorted({r for step_rows, _ in ctx.train_steps[:per_epoch] for r in step_rows})
    if not rows:
        return {}
    mine = batch.select(rows, ("old_logp", "logp", "mask"))
    sums = mismatch_sums(mine["old_logp"], mine["logp"], mine["mask"])
    if algo.off_policy == "geo_reject":
        out_B = L.geometric_rejected(mine["old_logp"], mine["logp"], mine["mask"], algo.is_low, algo.is_cap)
        sums["offpolicy/responses_dropped"] = float(out_B.sum())
    return sums


def actor_train_op(
    ctx: OpContext, batch: Batch, algo: AlgoConfig, temperature: float, old_key: str, kl_in_loss: bool
) -> dict:
    """The actor's optimizer steps (:func:`~loomrl.algorithms.ops.train_loop`), and the training-inference mismatch
    (:mod:`loomrl.algorithms.mismatch`): from the trainer's recomputed log-probs where ``old_key`` names them, else
    from the forward of the first optimizer step, the only one under the weights that generated the batch."""
    first = None
    if old_key != "old_logp" and ctx.train_steps:
        first = _FirstStepMismatch(batch.ids[r] for r in ctx.train_steps[0][0])
    loss_fn = partial(_actor_loss, ctx, algo=algo, old_key=old_key, kl_in_loss=kl_in_loss, first=first)
    out = train_loop(ctx, batch, loss_fn, temperature)
    sums = first.sums if first is not None else _recomputed_sums(ctx, batch, algo)
    out["stats"] = {**out["stats"], **sums}
    return out


def critic_train_op(ctx: OpContext, batch: Batch, algo: AlgoConfig) -> dict:
    return train_loop(ctx, batch, partial(_critic_loss, ctx, algo=algo))


_ADVANTAGES = {
    "ppo": ppo_advantages,
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "remax": remax_advantages,
    "reinforce_pp": reinforce_pp_advantages,
}


def advantages_op(ctx: OpContext, batch: Batch, algo: AlgoConfig, max_new_tokens: int, kl: bool = True) -> dict:
    """``algo.name``'s advantages from the rewards: the scores, less DAPO's overlong penalty where
    ``algo.overlong_buffer`` is set (then also a column ``overlong_penalty``, the amount taken; ReMax's greedy
    baseline is shaped alike, so baseline and sample are rewarded by one rule). With ``kl`` the per-token KL
    to the reference is a column ``kl`` too; without it (a workflow with no reference call) it is zero."""
    kl_BR = _seq_kl(batch, algo.kl_estimator) if kl else torch.zeros_like(batch["logp"])
    extra = {"kl": kl_BR} if kl else {}
    if not algo.overlong_buffer:
        return {**_ADVANTAGES[algo.name](ctx, batch, algo, kl_BR), **extra}
    penalty = partial(
        A.overlong_penalty, max_new_tokens=max_new_tokens, buffer=algo.overlong_buffer, penalty=algo.overlong_penalty
    )
    penalty_B = penalty(batch["mask"].sum(dim=-1))
    shaped = {"score": batch["score"] - penalty_B}
    if "greedy_score" in batch:
        greedy_len_B = torch.tensor([len(r) for r in batch["greedy_response_ids"]], device=penalty_B.device)
        shaped["greedy_score"] = batch["greedy_score"] - penalty(greedy_len_B)
    rewarded = Batch(batch.ids, {**batch.as_dict(), **shaped})
    return {**_ADVANTAGES[algo.name](ctx, rewarded, algo, kl_BR), **extra, "overlong_penalty": penalty_B}


def sampling_params(rollout: RolloutConfig) -> SamplingParams:
    return SamplingParams(rollout.max_new_tokens, rollout.temperature, rollout.top_k, rollout.top_p)


def judge_mfcs(reward: RewardConfig | None, backend: str = "loomrl") -> tuple[list[MFC], MFC | None]:
    """With ``reward.source`` 'judge': each judge's generate call (role ``judge<i>``, its verdicts in
    ``verdict<i>_ids``) and the compute call that turns the verdicts into the reward (``reward_inf``, in place of
    the reward role's inference call); ``([], None)`` otherwise."""
    if reward is None or reward.source != "judge":
        return [], None
    scored = ("prompt_text", "response_ids", "answer")
    gens = [
        MFC(
            f"{judge_role(i)}_gen",
            judge_role(i),
            MFCKind.GENERATE,
            scored,
            (f"verdict{i}_ids",),
            partial(
                judge_op,
                template=j.template,
                max_new_tokens=j.max_new_tokens,
                out_key=f"verdict{i}_ids",
                backend=backend,
            ),
            doc=f"judge {i}'s verdict on each response",
            max_new_tokens=j.max_new_tokens,
            reads_response=True,
        )
        for i, j in enumerate(reward.judges)
    ]
    keys = tuple(f"verdict{i}_ids" for i in range(len(gens)))
    readers = tuple((f"verdict{i}_ids", j.verdict, j.weight) for i, j in enumerate(reward.judges))
    score = MFC(
        "reward_inf",
        None,
        MFCKind.COMPUTE,
        ("prompt_ids", "response_ids", *keys),
        ("score", "rule_scores", *(f"{judge_role(i)}_unreadable" for i in range(len(gens)))),
        partial(verdict_op, judges=readers, rule_key="rule_scores"),
        doc="the judges' verdicts as rewards",
    )
    return gens, score


def _rollout_mfcs(
    algo: AlgoConfig,
    rollout: RolloutConfig,
    recompute: bool,
    reward: RewardConfig | None = None,
    reference: str = "ref",
) -> list[MFC]:
    """Generation and the inference calls that score it (shared by every algorithm); the reference's only
    where its log-probs weigh in (:func:`uses_reference`), on the ``reference`` role (``actor``: its base)."""
    gen, inf = MFCKind.GENERATE, MFCKind.INFERENCE
    seq, scored = ("prompt_ids", "response_ids"), ("prompt_ids", "response_ids", "prompt_text", "answer", "row")
    temp = rollout.temperature
    mfcs = [
        MFC(
            "actor_gen",
            "actor",
            gen,
            ("prompt_ids",),
            ("response_ids", "logp", "mask"),
            partial(generate_op, params=sampling_params(rollout), backend=rollout.backend),
            stream=partial(generate_chunks, params=sampling_params(rollout), backend=rollout.backend),
        ),
        MFC(
            "ref_inf",
            reference,
            inf,
            seq,
            ("ref_logp",),
            partial(logprob_op, out_key="ref_logp", temperature=temp, base=reference == "actor"),
        ),
        MFC("reward_inf", "reward", inf, scored, ("score", "rule_scores"), partial(reward_op, rule_key="rule_scores")),
    ]
    if rollout.env.enabled:  # episodes: their environment rewards them, no reward call
        mfcs[0] = episodes_mfc(rollout)
        del mfcs[2]
    if not uses_reference(algo):
        del mfcs[1]
    judges, judged = judge_mfcs(reward, rollout.backend)
    if judged is not None:
        if algo.name == "remax":
            raise ConfigError(
                "reward.source: 'judge' scores sampled responses; remax's greedy baseline needs a "
                "rule or reward model (valid with judge: ppo, grpo, rloo, reinforce_pp)"
            )
        at = [m.name for m in mfcs].index("reward_inf")
        mfcs[at : at + 1] = [*judges, judged]
    if recompute:
        mfcs.append(
            MFC(
                "actor_inf", "actor", inf, seq, ("old_logp",), partial(logprob_op, out_key="old_logp", temperature=temp)
            )
        )
    if algo.name == "ppo":
        mfcs.append(MFC("critic_inf", "critic", inf, seq, ("values",), values_op))
    if algo.name == "remax":  # the greedy rollout is the baseline
        greedy = SamplingParams(rollout.max_new_tokens, 0.0)
        mfcs.append(
            MFC(
                "actor_gen_greedy",
                "actor",
                gen,
                ("prompt_ids",),
                ("greedy_response_ids",),
                partial(generate_op, params=greedy, out_prefix="greedy_", backend=rollout.backend),
                stream=partial(generate_chunks, params=greedy, out_prefix="greedy_", backend=rollout.backend),
            )
        )
        mfcs.append(
            MFC(
                "reward_inf_greedy",
                "reward",
                inf,
                ("prompt_ids", "greedy_response_ids", "prompt_text", "answer", "row"),
                ("greedy_score",),
                partial(reward_op, response_key="greedy_response_ids", out_key="greedy_score"),
            )
        )
    return mfcs


def episodes_mfc(rollout: RolloutConfig) -> MFC:
    """The generate call of multi-turn rollouts (``rollout.env``): episodes, rewarded by their environment."""
    env = rollout.env
    return MFC(
        "actor_gen",
        "actor",
        MFCKind.GENERATE,
        ("prompt_ids", "prompt_text", "answer", "row"),
        ("response_ids", "logp", "mask", "score", "rule_scores", "episode_metrics", *_earned(rollout)),
        partial(episodes_op, params=sampling_params(rollout), env=env),
        doc=f"episodes with environment '{env.name}'",
        multi_turn=True,
    )


def _earned(rollout: RolloutConfig) -> tuple[str, ...]:
    """The earned-reward column where episodes credit by turn."""
    return (EARNED,) if rollout.env.enabled and rollout.env.credit == "turn" else ()


def uses_reference(algo: AlgoConfig) -> bool:
    """Whether the reference policy's log-probs change anything: only through the KL term, weighted by
    ``algo.kl_coef``. At 0 the workflow has no reference call and the run no reference model (the KL column and
    ``kl/mean`` metric go with it): the same updates for a forward pass less a batch, and one model less in
    memory."""
    return algo.kl_coef > 0


def build_workflow(
    algo: AlgoConfig, rollout: RolloutConfig, reward: RewardConfig | None = None, reference: str = "ref"
) -> Workflow:
    """The MFC graph of one iteration of ``algo.name``, with ``reward``'s judges where it has them; the KL
    reference's log-probs from the ``reference`` role (:attr:`~loomrl.config.schema.TrainConfig.reference_role`:
    ``ref``, or ``actor`` for a LoRA actor's base)."""
    # Truncated sampling (top-k/top-p) is not the distribution the actor trains; recompute behaviour log-probs
    # (also on request: frameworks whose sampler's log-probs differ from the trainer's recompute them always).
    # An off-policy correction needs both: the sampler's log-probs and the policy's at the update's start. Another
    # engine's log-probs (vLLM's) are the sampler's, not the trainer's: the trainer's are recomputed.
    recompute = (
        rollout.top_k > 0
        or rollout.top_p < 1.0
        or algo.recompute_logprobs
        or algo.off_policy != "none"
        or rollout.backend != "loomrl"
    )
    old_key = "old_logp" if recompute else "logp"
    mfcs = _rollout_mfcs(algo, rollout, recompute, reward, reference)
    kl = uses_reference(algo)
    adv_inputs = (
        ("logp", *(("ref_logp",) if kl else ()), "score", "mask")
        + {
            "ppo": ("values",),
            "remax": ("greedy_score",),
        }.get(algo.name, ())
        + _earned(rollout)
    )
    adv_outputs = ("advantages", *(("returns",) if algo.name == "ppo" else ()), *(("kl",) if kl else ()))
    if algo.overlong_buffer:
        adv_inputs += ("greedy_response_ids",) if algo.name == "remax" else ()
        adv_outputs += ("overlong_penalty",)
    mfcs.append(
        MFC(
            "advantages",
            None,
            MFCKind.COMPUTE,
            adv_inputs,
            adv_outputs,
            partial(advantages_op, algo=algo, max_new_tokens=rollout.max_new_tokens, kl=kl),
        )
    )
    seq = ("prompt_ids", "response_ids")
    kl_in_loss = algo.name == "grpo" and kl
    actor_inputs = (*seq, old_key, "advantages", "mask") + (("ref_logp",) if kl_in_loss else ())
    if recompute:  # the sampler's log-probs: the off-policy correction's and the mismatch's
        actor_inputs += ("logp",)
    steps = {"epochs": algo.ppo_epochs, "minibatches": algo.minibatches}
    mfcs.append(
        MFC(
            "actor_train",
            "actor",
            MFCKind.TRAIN,
            actor_inputs,
            (),
            partial(actor_train_op, algo=algo, temperature=rollout.temperature, old_key=old_key, kl_in_loss=kl_in_loss),
            loss_unit=L.LOSS_AGG_UNITS[algo.loss_agg],
            **steps,
        )
    )
    if algo.name == "ppo":
        mfcs.append(
            MFC(
                "critic_train",
                "critic",
                MFCKind.TRAIN,
                (*seq, "values", "returns", "mask"),
                (),
                partial(critic_train_op, algo=algo),
                **steps,
            )
        )
    return Workflow(mfcs, SOURCE_KEYS)
