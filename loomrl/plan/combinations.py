"""Which features combine: one table, checked once for every plan a run resolves.

A feature is a setting a user turns on (a config field or a part of ``runtime.plan``) together with the test of
whether a run has it on; an exclusion is a pair of features that do not run together, with why and what to do
instead. :func:`check_combinations` walks the exclusions after a plan is resolved (the trainer calls it for the
run's plan and each plan change), and its one-line refusals are generated from the table, so a new feature adds
rows here rather than a branch in the trainer, the executors or the config. Rules that need no plan (a setting
against another setting of the same config section) stay with that section's validation in
:mod:`loomrl.config.schema`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loomrl.errors import ConfigError
from loomrl.workflow.graph import MFCKind, Workflow

if TYPE_CHECKING:
    from loomrl.config.schema import TrainConfig
    from loomrl.plan.plan import ExecutionPlan

Test = Callable[["TrainConfig", Workflow, "ExecutionPlan"], bool]


@dataclass(frozen=True)
class Feature:
    """A feature of a run: where it is turned on, what it is called, and whether a run has it."""

    field: str
    """The setting that turns it on, as a user writes it (``rollout.backend``, ``runtime.plan``)."""
    name: str
    """What it is, in the words of a refusal (``stream fusion (fusion=... in runtime.plan)``)."""
    on: Test


def _parallel_generation(cfg: TrainConfig, workflow: Workflow, plan: ExecutionPlan) -> bool:
    """Whether a generate call of a trained role runs tensor- or pipeline-parallel, or FSDP-sharded."""
    for mfc in workflow:
        if mfc.kind is MFCKind.GENERATE and mfc.name in plan.allocations:
            alloc = plan[mfc.name]
            if alloc.layout.tp > 1 or alloc.layout.pp > 1 or alloc.fsdp:
                return True
    return False


FEATURES: dict[str, Feature] = {
    "vllm": Feature(
        "rollout.backend", "vLLM rollouts (rollout.backend=vllm)", lambda c, w, p: c.rollout.backend == "vllm"
    ),
    "stream_fusion": Feature(
        "runtime.plan", "stream fusion (stream_fusion=... in runtime.plan)", lambda c, w, p: p.stream_fusion is not None
    ),
    "parallel_generation": Feature(
        "runtime.plan", "a tensor-, pipeline- or FSDP-sharded generate layout", _parallel_generation
    ),
    "multi_turn": Feature(
        "rollout.env.name", "multi-turn episodes (rollout.env)", lambda c, w, p: c.rollout.env.enabled
    ),
    "lora_actor": Feature("actor.lora", "a LoRA actor (actor.lora)", lambda c, w, p: c.actor.lora.enabled),
    "asynchronous": Feature(
        "runtime.plan", "an asynchronous plan (async in runtime.plan)", lambda c, w, p: p.asynchronous is not None
    ),
    "partial_rollout": Feature(
        "runtime.plan",
        "partial rollouts (async=...,partial_rollout:on in runtime.plan)",
        lambda c, w, p: p.asynchronous is not None and p.asynchronous.partial_rollout,
    ),
    "dynamic_sampling": Feature(
        "algo.dynamic_sampling.enabled", "dynamic sampling", lambda c, w, p: c.algo.dynamic_sampling.enabled
    ),
    "dynamic_placement": Feature(
        "runtime.placement", "dynamic placement", lambda c, w, p: c.runtime.placement == "dynamic"
    ),
    "several_rollouts": Feature(
        "algo", "a workflow of several rollouts (remax)", lambda c, w, p: len(w.rollout_generations()) != 1
    ),
}


@dataclass(frozen=True)
class Exclusion:
    """Two features that do not run together; the refusal names ``first``'s field."""

    first: str
    second: str
    why: str
    instead: str

    def message(self) -> str:
        first, second = FEATURES[self.first], FEATURES[self.second]
        return f"{first.field}: not available with {second.name}: {self.why}; {self.instead}"


EXCLUSIONS: tuple[Exclusion, ...] = (
    Exclusion(
        "vllm",
        "stream_fusion",
        "vLLM returns a generate call's samples at its end, so none can stream into the scoring calls",
        "use rollout.backend=loomrl or a plan without fusion",
    ),
    Exclusion(
        "vllm",
        "multi_turn",
        "an episode keeps its keys and values across turns in loomrl's engine only",
        "use rollout.backend=loomrl",
    ),
    Exclusion(
        "vllm",
        "lora_actor",
        "vLLM's adapter loading is not wired to the actor's adapters",
        "use rollout.backend=loomrl or a full-weight actor",
    ),
    Exclusion(
        "vllm",
        "parallel_generation",
        "a vLLM engine runs in one worker's process over whole weights",
        "give generate calls dp-only layouts (tp=1, pp=1, no fsdp) or use rollout.backend=loomrl",
    ),
    Exclusion(
        "dynamic_sampling",
        "asynchronous",
        "its extra rounds would regenerate batches generated ahead",
        "use a synchronous plan or turn it off",
    ),
    Exclusion(
        "dynamic_placement",
        "asynchronous",
        "it changes plans between iterations while batches are in flight",
        "use a synchronous plan or a fixed placement",
    ),
    Exclusion(
        "multi_turn",
        "partial_rollout",
        "an episode's environment cannot pause mid-turn",
        "use partial_rollout:off",
    ),
    Exclusion(
        "several_rollouts",
        "partial_rollout",
        "partial rollouts continue the samples of one rollout generate call",
        "use partial_rollout:off",
    ),
)


def check_combinations(cfg: TrainConfig, workflow: Workflow, plan: ExecutionPlan) -> None:
    """Raise :class:`~loomrl.errors.ConfigError` with the first exclusion of :data:`EXCLUSIONS` the run has on."""
    on = {key: feature.on(cfg, workflow, plan) for key, feature in FEATURES.items()}
    for exclusion in EXCLUSIONS:
        if on[exclusion.first] and on[exclusion.second]:
            raise ConfigError(exclusion.message())
