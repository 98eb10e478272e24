"""What a process needs to build one role: a :class:`RoleSpec`, made from the run's config by the trainer.

Workers receive these specs (and the schedule they execute), never the whole config: a spec names the
model to load or draw, whether it trains and with which optimizer, and, for the reward role, how the task's
rule and the reward model combine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from loomrl.config.schema import LoraConfig, OptimConfig, TrainConfig, judge_index

__all__ = ["RoleSpec", "role_specs"]


@dataclass(frozen=True)
class RoleSpec:
    """One role's model and training."""

    name: str
    """The role: actor, ref, critic or reward."""
    model: str | None
    """A zoo model name or a local checkpoint directory; None for a rule-only reward (no model)."""
    field: str
    """The config field ``model`` came from, named in errors (e.g. ``critic.model``)."""
    value_head: bool = False
    """A value model (critic, reward model: per-token values from a score head) rather than a language model."""
    seed: int = 0
    """Seed of a zoo model's random initialisation (the same on every process, so replicas start alike)."""
    optim: OptimConfig | None = None
    """The optimizer of a trained role; None for a frozen one."""
    total_steps: int = 0
    """Optimizer steps of the whole run (the learning-rate schedule's length)."""
    on_nonfinite: str = "skip"
    """A trained role's optimizer step with a NaN or inf loss or gradient norm: 'skip' or 'stop'
    (``train.on_nonfinite``)."""
    lora: LoraConfig | None = None
    """Low-rank adapters trained instead of the whole model (:mod:`loomrl.models.lora`); None: every weight."""
    rule: bool = False
    """Reward only: add the task's rule-based score."""
    rule_weight: float = 1.0
    model_weight: float = 1.0

    @property
    def trained(self) -> bool:
        return self.optim is not None


def role_specs(cfg: TrainConfig, roles: Iterable[str]) -> dict[str, RoleSpec]:
    """The spec of each of ``roles`` under ``cfg``: the model of each (:meth:`TrainConfig.model_of`), the critic
    drawn with another seed, the reward model and rule as ``reward.source`` says, the judges frozen."""
    steps = cfg.loop.iterations * cfg.algo.ppo_epochs * cfg.algo.minibatches
    out = {}
    for role in roles:
        model, field = cfg.model_field(role)
        if role == "actor":
            spec = RoleSpec(
                role,
                model,
                field,
                seed=cfg.seed,
                optim=cfg.actor.optim,
                total_steps=steps,
                on_nonfinite=cfg.train.on_nonfinite,
                lora=cfg.actor.lora if cfg.actor.lora.enabled else None,
            )
        elif role == "critic":
            spec = RoleSpec(
                role,
                model,
                field,
                value_head=True,
                seed=cfg.seed + 1,
                optim=cfg.critic.optim,
                total_steps=steps,
                on_nonfinite=cfg.train.on_nonfinite,
                lora=cfg.critic.lora if cfg.critic.lora.enabled else None,
            )
        elif role == "reward":
            spec = RoleSpec(
                role,
                model,
                field,
                value_head=True,
                seed=cfg.seed,
                rule=cfg.reward.source in ("rule", "both"),
                rule_weight=cfg.reward.rule_weight,
                model_weight=cfg.reward.model_weight,
            )
        elif role == "ref":
            spec = RoleSpec(role, model, field, seed=cfg.seed)
        else:  # a judge: a frozen language model (model_field has refused any other name)
            spec = RoleSpec(role, model, field, seed=cfg.seed + 2 + (judge_index(role) or 0))
        out[role] = spec
    return out
