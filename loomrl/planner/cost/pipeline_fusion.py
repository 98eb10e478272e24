"""A fused train stage (intra-stage fusion) as a fusion problem: its schedule for the runtime and its price.

A ``fused_train`` schedule step (:mod:`loomrl.plan.schedule`) joins two train calls whose pipelines share the same
devices. The cost model prices each call's pipelined pass as ``mb + pp − 1`` slots of one stage's forward and
backward of one micro-batch (:mod:`loomrl.planner.cost.model`); the same slot, split 1 : 2 between forward and backward
(1 : 3 with recomputation), is each task's cost in a :class:`~loomrl.planner.pipeline_fusion.PipelineFusionProblem`
whose
stage placement is the two allocations' own (a reversed layout puts a model's stage 0 on the mesh's last
device). The fused schedule found for that problem is what the runtime runs
(:func:`pipeline_fusion_orders`) and what the simulator charges (:func:`price_pipeline_fusion`): each pair of
optimizer steps takes the schedule's makespan instead of the two pipelines' passes one after the other, and
the rest of each call (gradient sums, the optimizer step, …) is unchanged. A call with more optimizer steps
than the other runs its extra ones alone. The call's fitted corrections carry over: each call's slot is scaled
by the ratio of its corrected to its analytic time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from loomrl.plan.allocation import Allocation
from loomrl.plan.layout import Coords
from loomrl.plan.model_shape import ModelShape
from loomrl.plan.pipeline_fusion import PipelineFusionProblem, PipelineSpec
from loomrl.plan.schedule import Step
from loomrl.planner.pipeline_fusion.search import fused_order
from loomrl.workflow import MFC

__all__ = [
    "PipelineFusionModel",
    "PipelineFusionPrice",
    "can_pipeline_fuse",
    "pipeline_fusion_floor",
    "pipeline_fusion_orders",
    "pipeline_fusion_problem",
    "price_pipeline_fusion",
]

PIPELINE_TERMS = ("work", "pp_bubble", "tp_comm", "pp_p2p", "launch", "launch_tp")
"""The cost model's train terms that make up the pipelined passes (the rest follows each optimizer step)."""
SEARCH_ITERATIONS = 0
"""Annealing moves a schedule gets when a plan is priced: none, the generator's greedy start (deterministic, at
most a few tenths of a second for 16 stages, a few percent above the bound), since a plan
search prices many plans; the runtime then searches longer for the schedule it runs."""
RUNTIME_TIME_LIMIT_S = 10.0
"""Seconds the runtime spends on the schedule it runs, once per plan (it stops earlier at the lower bound)."""


class PipelineFusionModel(Protocol):
    """What pricing a pipeline-fusion stage asks of the cost model (:class:`~loomrl.planner.cost.model.CostModel`)."""

    @property
    def shapes(self) -> Mapping[str, ModelShape | None]:
        """Role → its model's shape (None for a role with no model: a rule)."""
        ...

    def mfc_time(self, mfc: MFC, alloc: Allocation) -> float:
        """Seconds of one call, corrected."""
        ...

    def time_terms(self, mfc: MFC, alloc: Allocation) -> dict[str, float]:
        """The call's uncorrected terms by name."""
        ...

    def train_steps(self, mfc: MFC) -> int:
        """Optimizer steps of one call of a train MFC."""
        ...


@dataclass(frozen=True)
class _Call:
    """One member's share of the price: its optimizer steps, its pipelined seconds per step (corrected) and
    the seconds of the rest of the call."""

    steps: int
    pipeline_s: float
    rest_s: float
    spec: PipelineSpec


@dataclass(frozen=True)
class PipelineFusionPrice:
    """A fused train stage's predicted seconds and how they divide."""

    seconds: float
    fused_step_s: float
    """One fused pipeline step (the schedule's makespan)."""
    separate_step_s: float
    """The two calls' pipelined passes of one optimizer step each, one after the other."""
    bound_s: float
    """The fusion problem's lower bound for one step."""


def _call(cost: PipelineFusionModel, member: Step) -> _Call:
    mfc, alloc = member.call_mfc, member.allocation
    terms = cost.time_terms(mfc, alloc)
    total = sum(terms.values())
    scale = cost.mfc_time(mfc, alloc) / total if total > 0 else 1.0
    steps = cost.train_steps(mfc)
    pipeline = scale * sum(v for k, v in terms.items() if k in PIPELINE_TERMS) / steps
    rest = scale * sum(v for k, v in terms.items() if k not in PIPELINE_TERMS)
    lay = alloc.layout
    slot = pipeline / (alloc.micro_batches + lay.pp - 1)
    passes = 4.0 if alloc.recompute else 3.0
    shape = cost.shapes[mfc.model_role]
    assert shape is not None  # a trained role has a model (time_terms above needs its shape)
    spec = PipelineSpec(
        lay.pp,
        alloc.micro_batches * lay.dp,
        max(slot / passes, 1e-12),
        max(slot * (passes - 1) / passes, 1e-12),
        activation=shape.hidden * shape.layers / lay.pp * (1 / passes if alloc.recompute else 1),
    )
    return _Call(steps, pipeline, rest, spec)


def can_pipeline_fuse(alloc: Allocation) -> bool:
    """Whether a train call on ``alloc`` may be half of a fused train stage (the plan's check:
    :func:`loomrl.plan.plan._check_pipeline_fusion`): a pipeline of one TP slice per stage, without FSDP."""
    return alloc.layout.pp > 1 and alloc.layout.tp == 1 and not alloc.fsdp


def pipeline_fusion_floor(cost: PipelineFusionModel, mfc: MFC, alloc: Allocation) -> float:
    """The least seconds a train call keeps each device of ``alloc`` busy in any fused stage: its time without
    its pipeline bubble, ``mb`` of its ``mb + pp − 1`` slots per step. A fused step is no shorter than its
    busiest device's work, and every device holds one stage of each model, so the two calls' floors add up to
    no more than the stage's price (:func:`price_pipeline_fusion`)."""
    terms = cost.time_terms(mfc, alloc)
    total = sum(terms.values())
    if total <= 0:
        return cost.mfc_time(mfc, alloc)
    pipeline = sum(v for k, v in terms.items() if k in PIPELINE_TERMS)
    bubble = pipeline * (alloc.layout.pp - 1) / (alloc.micro_batches + alloc.layout.pp - 1)
    return cost.mfc_time(mfc, alloc) * (total - bubble) / total


def pipeline_fusion_problem(
    first: Allocation, second: Allocation, specs: tuple[PipelineSpec, PipelineSpec]
) -> PipelineFusionProblem:
    """The fusion problem of two train allocations on one mesh: device ``i`` of the problem is the mesh's ``i``-th
    device, and each model's (replica, stage) sits where its layout puts it."""
    devices = first.devices

    def stage_devices(alloc: Allocation) -> tuple[tuple[int, ...], ...]:
        lay = alloc.layout
        return tuple(tuple(devices.index(alloc.device(Coords(s, r, 0))) for s in range(lay.pp)) for r in range(lay.dp))

    return PipelineFusionProblem(
        len(devices), specs[0], specs[1], stage_devices=(stage_devices(first), stage_devices(second))
    )


def _problem(cost: PipelineFusionModel, step: Step) -> tuple[PipelineFusionProblem, tuple[_Call, _Call]]:
    first, second = step.members  # the stage's two train calls
    calls = (_call(cost, first), _call(cost, second))
    return pipeline_fusion_problem(first.allocation, second.allocation, (calls[0].spec, calls[1].spec)), calls


def price_pipeline_fusion(cost: PipelineFusionModel, step: Step) -> PipelineFusionPrice:
    """Seconds of a ``fused_train`` step (module docstring)."""
    problem, calls = _problem(cost, step)
    result = fused_order(problem, seed=0, iterations=SEARCH_ITERATIONS)
    paired = min(c.steps for c in calls)
    alone = sum((c.steps - paired) * c.pipeline_s for c in calls)
    seconds = paired * result.makespan + alone + sum(c.rest_s for c in calls)
    return PipelineFusionPrice(seconds, result.makespan, sum(c.pipeline_s for c in calls), result.bound)


def pipeline_fusion_orders(cost: PipelineFusionModel, step: Step) -> dict[int, tuple[tuple[int, int, bool], ...]]:
    """Each device's order of one fused pipeline step, as :func:`loomrl.parallel.pipeline_fusion.
    pipeline_fusion_backward` takes it: ``(member index, micro-batch of its replica's rows, backward?)``."""
    problem, _ = _problem(cost, step)
    schedule = fused_order(problem, seed=0, time_limit_s=RUNTIME_TIME_LIMIT_S).schedule
    return local_orders(problem, schedule.devices, step.devices)


def local_orders(
    problem: PipelineFusionProblem, devices_tasks, devices: tuple[int, ...]
) -> dict[int, tuple[tuple[int, int, bool], ...]]:
    """A schedule's per-device task lists as local orders keyed by global device: micro-batches counted within
    the replica's own block."""
    return {
        devices[i]: tuple(
            (t.model, t.micro_batch - problem.micro_batches_of(t.model, t.replica).start, t.backward) for t in tasks
        )
        for i, tasks in enumerate(devices_tasks)
    }
