"""What the planner is given for one run, built once: :class:`PlannerInputs`.

Every price, simulation, search and re-plan of a run starts from the same few things: its workflow, its cluster
and the hardware profile the devices are priced with, each role's model architecture, one iteration's workload,
how the system runs the calls (:class:`~loomrl.planner.cost.system.SystemSettings`), fitted corrections and the
weights' element size. Two functions build them, and nothing else assembles them:

- :func:`inputs_from_config`: a training run's (``loomrl train``, its runtime's own pricing, dynamic placement,
  and a finished run calibrated or predicted again);
- :func:`~loomrl.planner.describe.inputs_from_description`: a run described for ``loomrl plan`` and the
  published-runs benchmark (:class:`~loomrl.planner.describe.RunDescription`), beside that description.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from loomrl.config.schema import TrainConfig
from loomrl.models.presets import model_config
from loomrl.plan.cluster import ClusterSpec, profile_for
from loomrl.plan.hardware import HardwareProfile, load_profile
from loomrl.plan.model_shape import ModelShape
from loomrl.planner.cost.corrections import Corrections
from loomrl.planner.cost.model import PRECISION_BYTES, CostModel
from loomrl.planner.cost.system import RUNTIME, SystemSettings
from loomrl.planner.cost.workload import EpisodeShape, Workload
from loomrl.workflow import Workflow

__all__ = ["PlannerInputs", "inputs_from_config", "sharing_profile"]


@dataclass(frozen=True)
class PlannerInputs:
    """One run as the planner prices it (module docstring). Immutable; :meth:`with_workload` and
    :meth:`cost_model` give the variants a run needs as it observes itself, sharing the priced reallocations."""

    workflow: Workflow
    cluster: ClusterSpec
    profile: HardwareProfile
    """The hardware profile the devices are priced with (a measured one, or the cluster's, devices sharing cores
    where they do: :func:`sharing_profile`)."""
    configs: Mapping[str, Any]
    """Each role's architecture, an HF-config-like object (None for a reward without a model: a rule)."""
    workload: Workload
    settings: SystemSettings = RUNTIME
    corrections: Corrections | None = None
    """Fitted corrections (None: the analytic model as it is)."""
    bytes_per_param: int | None = None
    """The weights' element size (None: the cost model's default on the profile, as ``precision: auto``)."""
    adapters: Mapping[str, tuple[int, tuple[str, ...]]] = field(default_factory=dict)
    """Each LoRA role's adapters, ``(rank, target projections)``: what it trains and moves."""
    reallocs: dict[tuple, float] = field(default_factory=dict, compare=False, repr=False)
    """Priced reallocations, shared by every cost model made from these inputs (they depend only on the
    cluster, profile, shapes and element size)."""

    @cached_property
    def shapes(self) -> dict[str, ModelShape | None]:
        """Each role's model shape (None for a rule), with its LoRA adapters where it has them."""
        return {
            role: None if cfg is None else ModelShape.from_config(cfg).with_lora(*self.adapters.get(role, (0, ())))
            for role, cfg in self.configs.items()
        }

    @property
    def memory_per_device(self) -> float:
        """Bytes each device holds (the profile's, which is the cluster's ``memory_gb``)."""
        return self.profile.memory_bytes

    def workload_of(
        self, lengths: Sequence[int], prompt_len: float, metrics: Mapping[str, float] | None = None
    ) -> Workload:
        """This run's workload with observed response ``lengths`` and mean ``prompt_len``: the same batch,
        optimizer steps and groups; a multi-turn run's episodes as ``metrics`` measured them, where they did
        (:meth:`~loomrl.planner.cost.workload.EpisodeShape.from_metrics`)."""
        episodes = EpisodeShape.from_metrics(metrics or {}) if self.workload.episodes is not None else None
        return dataclasses.replace(
            self.workload,
            prompt_len=prompt_len,
            response_lengths=tuple(max(1, int(n)) for n in lengths),
            episodes=episodes or self.workload.episodes,
        )

    def with_workload(self, workload: Workload) -> PlannerInputs:
        """These inputs for another workload (the priced reallocations shared)."""
        return dataclasses.replace(self, workload=workload)

    def cost_model(self, workload: Workload | None = None, corrections: Corrections | None = None) -> CostModel:
        """The cost model of these inputs, for ``workload`` and ``corrections`` where given (else their own)."""
        return CostModel(
            self.cluster,
            self.profile,
            self.shapes,
            workload or self.workload,
            corrections if corrections is not None else self.corrections,
            bytes_per_param=self.bytes_per_param,
            settings=self.settings,
            realloc_cache=self.reallocs,
        )


def sharing_profile(profile: HardwareProfile, cluster: ClusterSpec, cores: int | None) -> HardwareProfile:
    """``profile`` with ``cluster``'s devices sharing ``cores`` cores: a CPU machine (the ``local`` profile)
    running more worker processes than it has cores; unchanged when ``cores`` is unknown or for accelerators."""
    if cores is None or profile.name != "local":
        return profile
    return dataclasses.replace(profile, devices_share_cores=max(1, math.ceil(cluster.n_devices / cores)))


def inputs_from_config(
    cfg: TrainConfig,
    cluster: ClusterSpec,
    *,
    workflow: Workflow | None = None,
    profile: HardwareProfile | None = None,
    cores: int | None = None,
    lengths: Sequence[int] | None = None,
    prompt_len: float = 0.0,
    corrections: Corrections | None = None,
    tokenizer: Any = None,
    episodes: EpisodeShape | None = None,
) -> PlannerInputs:
    """A training run's planner inputs on ``cluster``.

    - ``workflow``: the run's (built from ``cfg`` where not given);
    - ``profile``: a measured profile to price with; by default ``runtime.cost_profile`` where set, else the
      cluster's; its devices share ``cores`` cores where given (a run's worker processes on this machine);
    - ``lengths``, ``prompt_len``: the observed workload (by default every response ``rollout.max_new_tokens``
      long, prompts of ``prompt_len``);
    - ``corrections``: by default ``runtime.cost_corrections`` where set;
    - ``tokenizer``: the run's (a zoo model's vocabulary comes from it; by default the task's tokenizer);
    - ``episodes``: a multi-turn run's episodes as observed (by default every episode ``rollout.env.max_turns``
      turns long, with no observation tokens and an instant environment).
    """
    from loomrl.algorithms.workflows import build_workflow

    rt = cfg.runtime
    workflow = workflow or build_workflow(cfg.algo, cfg.rollout, cfg.reward, cfg.reference_role)
    if profile is None:
        profile = load_profile(rt.cost_profile) if rt.cost_profile else profile_for(cluster)
    if corrections is None and rt.cost_corrections:
        corrections = Corrections.load(rt.cost_corrections)
    models = {role: cfg.model_of(role) for role in workflow.roles()}
    if tokenizer is None and any(models.values()):
        from loomrl.models.tokenizer import task_tokenizer  # transformers: only for a run with models

        tokenizer = task_tokenizer(cfg.task, cfg.actor.model)
    configs = {role: None if model is None else model_config(model, tokenizer) for role, model in models.items()}
    algo = cfg.algo
    workload = Workload(
        cfg.rollout.prompts_per_iter * algo.samples_per_prompt,
        prompt_len,
        tuple(lengths) if lengths else (cfg.rollout.max_new_tokens,),
        ppo_epochs=algo.ppo_epochs,
        minibatches=algo.minibatches,
        samples_per_prompt=algo.samples_per_prompt,
        episodes=episodes or (EpisodeShape(cfg.rollout.env.max_turns) if cfg.rollout.env.enabled else None),
    )
    adapters = {
        role: (lora.r, lora.target_modules)
        for role, lora in (("actor", cfg.actor.lora), ("critic", cfg.critic.lora))
        if lora.enabled and role in configs
    }
    return PlannerInputs(
        workflow,
        cluster,
        sharing_profile(profile, cluster, cores),
        configs,
        workload,
        RUNTIME,
        corrections,
        PRECISION_BYTES.get(rt.precision),
        adapters,
    )
