"""A run described for the planner: models, cluster, data shape, optimizer steps, system settings and a plan.

:class:`RunDescription` is what ``loomrl plan`` reads from its flags or from a workload file (YAML, the same
fields), and what ``benchmarks/published_runs.py`` writes down for each published run: everything the
simulator needs to price a run as its publication states it. :func:`inputs_from_description` turns it into the
planner's inputs (:class:`~loomrl.planner.inputs.PlannerInputs`); :func:`simulate_fixed` simulates a given plan and
:func:`stage_seconds` reads a simulated iteration back as the stages publications report (generation, weight
sync, scoring, training).

Models are names of :data:`~loomrl.models.presets.MODEL_PRESETS`, HF ``config.json`` files, zoo models or
checkpoint directories; a reward of ``rule`` has no model (a verifier scoring on the host).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from loomrl.config.schema import (
    ALGORITHMS,
    GROUP_ALGORITHMS,
    AlgoConfig,
    JudgeConfig,
    RewardConfig,
    RolloutConfig,
    judge_index,
)
from loomrl.config.tools import ValidatedConfig, fail, spec
from loomrl.errors import ConfigError
from loomrl.models.presets import model_config
from loomrl.plan import ClusterSpec, ExecutionPlan
from loomrl.plan.cluster import profile_for
from loomrl.plan.hardware import HardwareProfile
from loomrl.planner.cost.corrections import Corrections
from loomrl.planner.cost.system import SystemSettings
from loomrl.planner.cost.workload import DEFAULT_SPREAD, Workload, lengths_from_mean_max
from loomrl.planner.inputs import PlannerInputs
from loomrl.planner.simulation.simulator import SimResult, simulate
from loomrl.workflow import Workflow

__all__ = [
    "RULE",
    "STAGES",
    "FixedPlanReport",
    "ModelsConfig",
    "RunDescription",
    "inputs_from_description",
    "simulate_fixed",
    "stage_seconds",
]

RULE = "rule"
"""The model name of a reward with no model: a rule (a verifier) scores on the host."""


@dataclass(frozen=True)
class ModelsConfig(ValidatedConfig):
    """Each role's architecture: a preset, an HF ``config.json``, a zoo model or a checkpoint directory."""

    actor: str = "llama2-7b"
    """The policy (and, unless given, every other role)."""
    critic: str | None = None
    """The value model (PPO); default: the actor's architecture."""
    ref: str | None = None
    """The reference policy; default: the actor's architecture."""
    reward: str | None = None
    """The reward model, or ``rule`` for a rule-based reward with no model; default: the actor's architecture."""
    judges: tuple[str, ...] = ()
    """Generative reward models (G-Core's): each a role ``judge<i>`` whose generate call reads the prompt and the
    response and writes a verdict of ``judge_tokens`` tokens; they replace the reward model."""

    def of(self, role: str) -> str:
        """The model name of ``role``."""
        index = judge_index(role)
        if index is not None:
            return self.judges[index]
        return getattr(self, role, None) or self.actor


@dataclass(frozen=True)
class RunDescription(ValidatedConfig):
    """One RL run as the planner sees it (see the module docstring)."""

    algo: str = spec("ppo", choices=ALGORITHMS)
    """RL algorithm: its workflow (PPO has a critic; GRPO and RLOO sample groups)."""
    cluster: str = "h100:1x8"
    """Devices: KIND:NODESxDEVICES, e.g. h100:4x8, a800:4x8, gb200:1x16 (a node is an NVLink domain)."""
    models: ModelsConfig = field(default_factory=ModelsConfig)
    """Architectures of the roles."""
    prompts: int = spec(512, ge=1)
    """Prompts per iteration."""
    responses_per_prompt: int = spec(1, ge=1)
    """Responses sampled per prompt (a group of GRPO/RLOO, or several samples for any algorithm)."""
    prompt_len: float = spec(128.0, ge=0)
    """Mean prompt length in tokens."""
    response_len: float | None = spec(None, ge=1)
    """Mean response length in tokens; default: ``response_max`` (every response that long)."""
    response_max: int | None = spec(None, ge=1)
    """Longest response (the generation limit); default: ``response_len`` (every response that long)."""
    response_spread: float = spec(DEFAULT_SPREAD, gt=0)
    """σ of the log-normal response lengths between the mean and the limit (a stated shape, see
    :data:`~loomrl.planner.cost.workload.DEFAULT_SPREAD`)."""
    observed_lengths: tuple[int, ...] | None = spec(None, ge=1)
    """Observed response lengths (e.g. a run's), used as they are; they replace ``response_len``,
    ``response_max`` and ``response_spread`` (:mod:`loomrl.planner.cost.lengths`)."""
    optimizer_steps: int = spec(1, ge=1)
    """Optimizer steps per epoch over an iteration's samples (its minibatches)."""
    ppo_epochs: int = spec(1, ge=1)
    """Passes over the samples per iteration."""
    recompute_logprobs: bool = False
    """An ``actor_inf`` call recomputes the behaviour log-probs after generation (verl, OpenRLHF, NeMo RL)."""
    kl: bool = True
    """A KL term to the reference policy: a reference model and its pass (False: none, as recipes with a KL
    coefficient of 0 run, e.g. verl's DAPO)."""
    decode_slots: int | None = spec(None, ge=1)
    """Samples one generation replica decodes at once (loomrl's rollout engine); see also ``system``."""
    judge_tokens: int = spec(8, ge=1)
    """Tokens of each judge's verdict (models.judges)."""
    generated_per_kept: float = spec(1.0, ge=1)
    """Samples generated and scored per sample trained: above 1 with dynamic sampling (a run's sampling/prompts over
    rollout.prompts_per_iter); generation and the reward call are priced that many times over."""
    plan: str | None = None
    """A fixed plan to simulate (a strategy, a plan string or a plan file); None: compare and search."""
    system: SystemSettings = field(default_factory=SystemSettings)
    """How the system runs the calls: serving engine, precisions, offloading (loomrl's runtime by default)."""

    RENAMED: ClassVar[Mapping[str, str]] = {"engine": "system"}
    """Keys of earlier releases' workload files, refused with their new names."""

    def validate(self) -> None:
        if self.observed_lengths is not None and not self.observed_lengths:
            fail("observed_lengths", "is empty: give at least one length, or null to use response_len")
        if self.response_len is None and self.response_max is None and self.observed_lengths is None:
            fail("response_len", "None with response_max None: give the mean, the limit or both")
        if self.response_len is not None and self.response_max is not None and self.response_len > self.response_max:
            fail("response_len", f"{self.response_len} is above response_max={self.response_max}")
        if self.system.partial_rollout and self.plan is None:
            fail("system.partial_rollout", "prices a given asynchronous plan only: give plan (with async=N)")
        if self.algo in GROUP_ALGORITHMS and self.responses_per_prompt < 2:
            fail("responses_per_prompt", f"{self.responses_per_prompt} is too small for {self.algo} (must be >= 2)")
        ClusterSpec.parse(self.cluster)

    def response_lengths(self) -> tuple[int, ...]:
        """A sample of the response lengths: one length when only the mean or the limit is given (or they are
        equal), else the cut log-normal of :func:`~loomrl.planner.cost.workload.lengths_from_mean_max`; observed
        ``observed_lengths`` as they are."""
        if self.observed_lengths is not None:
            return tuple(int(n) for n in self.observed_lengths)
        if self.response_max is None or self.response_len is None:
            given = self.response_len or self.response_max
            assert given is not None  # validate: the mean, the limit or both
            return (max(1, round(given)),)
        return lengths_from_mean_max(self.response_len, self.response_max, self.response_spread)

    def workflow(self) -> Workflow:
        """The workflow of ``algo`` with this run's steps per iteration and log-prob recomputation."""
        from loomrl.algorithms.workflows import build_workflow

        group = max(2, self.responses_per_prompt) if self.algo in GROUP_ALGORITHMS else 4
        algo = AlgoConfig(
            name=self.algo,
            ppo_epochs=self.ppo_epochs,
            minibatches=self.optimizer_steps,
            group_size=group,
            recompute_logprobs=self.recompute_logprobs,
            kl_coef=AlgoConfig.kl_coef if self.kl else 0.0,
        )
        reward = None
        if self.models.judges:
            reward = RewardConfig(
                source="judge",
                judges=tuple(JudgeConfig(model=name, max_new_tokens=self.judge_tokens) for name in self.models.judges),
            )
        return build_workflow(algo, RolloutConfig(), reward)

    def workload(self) -> Workload:
        """One iteration's data: prompts × responses per prompt samples of the described lengths."""
        return Workload(
            batch=self.prompts * self.responses_per_prompt,
            prompt_len=self.prompt_len,
            response_lengths=self.response_lengths(),
            ppo_epochs=self.ppo_epochs,
            minibatches=self.optimizer_steps,
            decode_slots=self.decode_slots,
            rollout_scale=self.generated_per_kept,
            samples_per_prompt=self.responses_per_prompt,
        )


def inputs_from_description(
    run: RunDescription,
    *,
    profile: HardwareProfile | None = None,
    corrections: Corrections | None = None,
    bytes_per_param: int | None = None,
) -> PlannerInputs:
    """The planner's inputs of ``run``: its workflow, cluster, each role's architecture (None for a rule reward),
    workload and system settings; ``profile`` by default the cluster's."""
    workflow = run.workflow()
    for role in workflow.roles():
        if role != "reward" and run.models.of(role) == RULE:
            raise ConfigError(
                f"models.{role}: '{RULE}' means no model, which only a reward may be; give an "
                "architecture (a preset, a config.json, a zoo model or a checkpoint directory)"
            )
    configs = {
        role: None if run.models.of(role) == RULE else model_config(run.models.of(role)) for role in workflow.roles()
    }
    cluster = ClusterSpec.parse(run.cluster)
    return PlannerInputs(
        workflow,
        cluster,
        profile or profile_for(cluster),
        configs,
        run.workload(),
        run.system,
        corrections,
        bytes_per_param,
    )


STAGES: dict[str, tuple[str, ...]] = {
    "generation": ("actor_gen",),
    "weight sync": (
        "copy actor",
        "sync actor",
        "free actor",
        "offload actor state",
        "reload actor state",
        "offload critic state",
        "reload critic state",
    ),
    "scoring": (
        "actor_inf",
        "ref_inf",
        "reward_inf",
        "critic_inf",
        "advantages",
        "reload ",
        "offload ",
        "judge",
        "copy judge",
        "free judge",
    ),
    "training": ("actor_train", "critic_train", "copy critic", "free critic"),
}
"""The stages publications break an RL step into, each the steps whose ids start with one of its prefixes: the
actor's generation; moving its weights into the generation engine (copies, shadow syncs) and the trainers' state
out of its way and back; the scoring passes (log-probs, reward, values, advantages, and moving frozen models in
and out); training."""


def stage_seconds(
    result: SimResult, stages: Mapping[str, Sequence[str]] = STAGES, iteration: int | None = None
) -> dict[str, float]:
    """Seconds of each stage in one simulated iteration (the middle one by default): the time some device runs
    one of the stage's steps (the union of their intervals, so overlapping steps count once). Steps no stage
    names fall in ``other``; a trained role's training state moved out and back (``offload``/``reload`` of a
    trained role) counts where its prefix puts it."""
    ends = result.iteration_ends
    it = (len(ends) // 2 if ends else 0) if iteration is None else iteration
    spans: dict[str, list[tuple[float, float]]] = {name: [] for name in (*stages, "other")}
    for interval in result.timeline:
        if interval.iteration != it:
            continue
        name = next((s for s, prefixes in stages.items() if interval.label.startswith(tuple(prefixes))), "other")
        spans[name].append((interval.start, interval.end))
    return {name: _union(found) for name, found in spans.items() if found or name != "other"}


def _union(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


@dataclass
class FixedPlanReport:
    """A given plan simulated: its result, the stages of one iteration, and each call's seconds."""

    plan: ExecutionPlan
    result: SimResult
    stages: dict[str, float]
    """Stage → seconds in one steady iteration (:func:`stage_seconds`)."""
    calls: dict[str, float]
    """Step id → seconds it runs in that iteration (on its busiest device)."""


def simulate_fixed(
    plan: ExecutionPlan, inputs: PlannerInputs, stages: Mapping[str, tuple[str, ...]] | None = None
) -> FixedPlanReport:
    """Simulate ``plan`` as it is (a published run's, or one to compare with a run of one's own) on ``inputs``
    and read its iteration back as stages (``stages``: stage → step-id prefixes; by default :data:`STAGES`)."""
    if inputs.settings.partial_rollout and plan.asynchronous is None:
        raise ConfigError("system.partial_rollout: needs an asynchronous plan (async=N in the plan)")
    result = simulate(plan, inputs.workflow, inputs.cost_model(), inputs.memory_per_device)
    middle = len(result.iteration_ends) // 2
    calls: dict[str, float] = {}
    for interval in result.timeline:
        if interval.iteration == middle:
            calls[interval.label] = max(calls.get(interval.label, 0.0), interval.end - interval.start)
    return FixedPlanReport(plan, result, stage_seconds(result, stages or STAGES), calls)
