"""What an intra-stage fusion schedule is about: two pipelines on one row of devices, their tasks, a schedule.

An actor and a critic both train with pipeline parallelism on the same ``D`` devices (RLHFuse's intra-stage
fusion). The actor's stages run left to right, the critic's right to left, so a device holding one model's early
stages holds the other's late ones and either model's micro-batches can fill the other's pipeline bubbles. A
model of depth ``P < D`` is replicated ``K = D / P`` times (its fusion factor), each replica taking a contiguous
block of the model's micro-batches, so that every device holds exactly one stage of each model.

A :class:`PipelineTask` is one stage's forward or backward of one micro-batch; a :class:`TaskOrder` is each device's
tasks in execution order. Its communication is implied: a forward's output goes to the next stage's device, a
backward's input gradient to the previous stage's device, each after ``hop_s``. Memory is counted in the units
of :attr:`PipelineSpec.activation`: a micro-batch's activations stay on a stage from its forward to its backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ACTOR, CRITIC = 0, 1
"""Model indices (the actor's stages run left to right, the critic's right to left)."""
MODELS = (ACTOR, CRITIC)
MODEL_NAMES = ("actor", "critic")

__all__ = [
    "ACTOR",
    "CRITIC",
    "MODELS",
    "MODEL_NAMES",
    "PipelineFusionProblem",
    "PipelineSpec",
    "TaskOrder",
    "PipelineTask",
]


@dataclass(frozen=True)
class PipelineSpec:
    """One model's pipeline: its depth, its micro-batches and what one stage's work on one micro-batch costs."""

    depth: int
    """Pipeline stages ``P`` of this model."""
    micro_batches: int
    """``M``: micro-batches of one training step, in total over all of this model's replicas."""
    forward_s: float = 1.0
    """Seconds of one stage's forward of one micro-batch."""
    backward_s: float = 2.0
    """Seconds of one stage's backward of one micro-batch (the last stage's includes the loss)."""
    activation: float = 1.0
    """Memory one micro-batch's activations hold on one stage from its forward until its backward."""

    def __post_init__(self) -> None:
        for name in ("depth", "micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PipelineSpec.{name}: {value!r} is not a positive integer")
        for name in ("forward_s", "backward_s", "activation"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"PipelineSpec.{name}: {value!r} is not a positive finite number")
            object.__setattr__(self, name, float(value))


@dataclass(frozen=True)
class PipelineFusionProblem:
    """Two pipelines fused on one row of devices (module docstring)."""

    devices: int
    """``D``; each model's depth divides it, and the model runs ``D // depth`` replicas."""
    actor: PipelineSpec
    """Stages left to right: replica ``r`` stage ``s`` on device ``r * P + s``."""
    critic: PipelineSpec
    """Stages right to left: replica ``r`` stage ``s`` on device ``(r + 1) * P - 1 - s``."""
    memory_cap: tuple[float, ...] | None = None
    """Activation memory each device may hold at once; None: on each device, the sum of both models' 1F1B peaks
    there (stage ``s`` of depth ``P`` keeps ``min(P - s, micro-batches of its replica)`` micro-batches)."""
    hop_s: float = 0.0
    """Seconds for an activation or a gradient to travel between neighbouring stages' devices."""
    stage_devices: tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]] | None = None
    """Per model, per replica, the device of each stage, where two allocations place them otherwise (a reversed
    layout with replicas interleaves them: :func:`loomrl.planner.cost.pipeline_fusion.pipeline_fusion_problem`); None:
    the
    directions above."""

    def __post_init__(self) -> None:
        if not isinstance(self.devices, int) or isinstance(self.devices, bool) or self.devices < 1:
            raise ValueError(f"PipelineFusionProblem.devices: {self.devices!r} is not a positive integer")
        for _model, name in zip(MODELS, MODEL_NAMES):
            spec = getattr(self, name)
            if not isinstance(spec, PipelineSpec):
                raise ValueError(f"PipelineFusionProblem.{name}: {spec!r} is not a PipelineSpec")
            if self.devices % spec.depth:
                raise ValueError(
                    f"PipelineFusionProblem.{name}.depth: {spec.depth} does not divide devices={self.devices}"
                )
            replicas = self.devices // spec.depth
            if spec.micro_batches % replicas:
                raise ValueError(
                    f"PipelineFusionProblem.{name}.micro_batches: {spec.micro_batches} is not a multiple of "
                    f"its {replicas} replicas"
                )
        if self.stage_devices is not None:
            self._check_stage_devices()
        if (
            isinstance(self.hop_s, bool)
            or not isinstance(self.hop_s, (int, float))
            or not math.isfinite(self.hop_s)
            or self.hop_s < 0
        ):
            raise ValueError(f"PipelineFusionProblem.hop_s: {self.hop_s!r} is not a finite number >= 0")
        object.__setattr__(self, "hop_s", float(self.hop_s))
        if self.memory_cap is None:
            object.__setattr__(self, "memory_cap", self._one_f_one_b_peaks())
            return
        cap = tuple(self.memory_cap) if isinstance(self.memory_cap, (tuple, list)) else None
        if cap is None or len(cap) != self.devices:
            raise ValueError(
                f"PipelineFusionProblem.memory_cap: {self.memory_cap!r} is not one number per device ({self.devices})"
            )
        least = self.actor.activation + self.critic.activation
        for device, value in enumerate(cap):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= least:
                raise ValueError(
                    f"PipelineFusionProblem.memory_cap[{device}]: {value!r} is below one micro-batch of each "
                    f"model ({least:g})"
                )
        object.__setattr__(self, "memory_cap", tuple(float(v) for v in cap))

    def _check_stage_devices(self) -> None:
        assert self.stage_devices is not None  # checked when given
        stage_devices = tuple(tuple(tuple(int(d) for d in stages) for stages in model) for model in self.stage_devices)
        if len(stage_devices) != len(MODELS):
            raise ValueError(f"PipelineFusionProblem.stage_devices: {self.stage_devices!r} is not one entry per model")
        for model, name in zip(MODELS, MODEL_NAMES):
            spec, replicas = self.spec(model), self.devices // self.spec(model).depth
            shape = [len(stages) for stages in stage_devices[model]]
            if shape != [spec.depth] * replicas:
                raise ValueError(
                    f"PipelineFusionProblem.stage_devices[{name}]: {shape} stages per replica, expected "
                    f"{replicas} replicas of {spec.depth}"
                )
            if sorted(d for stages in stage_devices[model] for d in stages) != list(range(self.devices)):
                raise ValueError(
                    f"PipelineFusionProblem.stage_devices[{name}]: {stage_devices[model]} does not put one stage on "
                    f"each of the devices 0..{self.devices - 1}"
                )
        object.__setattr__(self, "stage_devices", stage_devices)

    @property
    def caps(self) -> tuple[float, ...]:
        """``memory_cap`` as made: one number per device (the default filled in)."""
        assert self.memory_cap is not None  # __post_init__ fills it in
        return self.memory_cap

    def _one_f_one_b_peaks(self) -> tuple[float, ...]:
        return tuple(sum(self.one_f_one_b_memory(m, d) for m in MODELS) for d in range(self.devices))

    def one_f_one_b_memory(self, model: int, device: int) -> float:
        """The most activation memory ``model``'s own 1F1B schedule holds on ``device``: stage ``s`` of depth ``P``
        keeps ``min(P - s, micro-batches of its replica)`` micro-batches."""
        spec = self.spec(model)
        stage = self.stage_on(model, device)[1]
        return min(spec.depth - stage, spec.micro_batches // self.replicas(model)) * spec.activation

    def spec(self, model: int) -> PipelineSpec:
        """The pipeline of ``model`` (:data:`ACTOR` or :data:`CRITIC`)."""
        if model == ACTOR:
            return self.actor
        if model == CRITIC:
            return self.critic
        raise ValueError(f"model: {model!r} is not ACTOR (0) or CRITIC (1)")

    def replicas(self, model: int) -> int:
        """``K``, the fusion factor: how many copies of ``model``'s pipeline span the devices."""
        return self.devices // self.spec(model).depth

    def device_of(self, model: int, replica: int, stage: int) -> int:
        """The device that runs ``stage`` of ``replica`` of ``model``."""
        depth = self.spec(model).depth
        if not 0 <= replica < self.replicas(model) or not 0 <= stage < depth:
            raise ValueError(
                f"{MODEL_NAMES[model]} has no replica {replica} stage {stage} "
                f"({self.replicas(model)} replicas of {depth} stages)"
            )
        if self.stage_devices is not None:
            return self.stage_devices[model][replica][stage]
        return replica * depth + stage if model == ACTOR else (replica + 1) * depth - 1 - stage

    def stage_on(self, model: int, device: int) -> tuple[int, int]:
        """(replica, stage) of ``model`` on ``device``."""
        if not 0 <= device < self.devices:
            raise ValueError(f"device: {device!r} is not in 0..{self.devices - 1}")
        if self.stage_devices is not None:
            return next(
                (r, s)
                for r, stages in enumerate(self.stage_devices[model])
                for s, d in enumerate(stages)
                if d == device
            )
        depth = self.spec(model).depth
        replica, offset = divmod(device, depth)
        return replica, offset if model == ACTOR else depth - 1 - offset

    def micro_batches_of(self, model: int, replica: int) -> range:
        """The micro-batches replica ``replica`` of ``model`` trains: a contiguous block of ``M / K``."""
        per = self.spec(model).micro_batches // self.replicas(model)
        return range(replica * per, (replica + 1) * per)

    def tasks(self) -> tuple[PipelineTask, ...]:
        """Every task of the problem, sorted."""
        out = []
        for model in MODELS:
            for replica in range(self.replicas(model)):
                for stage in range(self.spec(model).depth):
                    for k in self.micro_batches_of(model, replica):
                        out += [
                            PipelineTask(model, replica, stage, k, False),
                            PipelineTask(model, replica, stage, k, True),
                        ]
        return tuple(sorted(out))

    def device_of_task(self, task: PipelineTask) -> int:
        return self.device_of(task.model, task.replica, task.stage)

    def duration(self, task: PipelineTask) -> float:
        spec = self.spec(task.model)
        return spec.backward_s if task.backward else spec.forward_s


@dataclass(frozen=True, order=True)
class PipelineTask:
    """One stage's forward or backward of one micro-batch (``micro_batch`` counts over all replicas)."""

    model: int
    replica: int
    stage: int
    micro_batch: int
    backward: bool

    def __str__(self) -> str:
        return f"{'ac'[self.model]}{'B' if self.backward else 'F'}{self.micro_batch}@s{self.stage}" + (
            f"r{self.replica}" if self.replica else ""
        )


@dataclass(frozen=True)
class TaskOrder:
    """Each device's tasks in execution order; :func:`~loomrl.planner.pipeline_fusion.check` says whether it is
    valid. A forward's output goes to the next stage's device, a backward's input gradient to the previous."""

    problem: PipelineFusionProblem
    devices: tuple[tuple[PipelineTask, ...], ...]
    """Per device, its tasks in execution order."""

    def __post_init__(self) -> None:
        devices = tuple(tuple(order) for order in self.devices)
        if len(devices) != self.problem.devices:
            raise ValueError(f"TaskOrder.devices: {len(devices)} task lists for {self.problem.devices} devices")
        object.__setattr__(self, "devices", devices)

    def text(self) -> str:
        """One line per device: ``d3: aF0@s3 cF0@s4 ...``."""
        return "\n".join(f"d{d}: " + " ".join(map(str, order)) for d, order in enumerate(self.devices))
