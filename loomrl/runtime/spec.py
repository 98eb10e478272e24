"""What the controller hands its workers: the settings and roles of a device (:class:`WorkerSpec`), the steps
it executes with their transfer plans (:class:`WorkerPlan`), and one call's rows (:class:`CallData`).

A worker never sees the run's whole config: it gets the specs of the models it may host, the few settings that
reach a device, and the schedule (:mod:`loomrl.plan.schedule`) whose steps it runs when told.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from loomrl.algorithms.context import PartialRollout
from loomrl.config.environment import EnvConfig
from loomrl.config.schema import TaskConfig
from loomrl.plan.allocation import Allocation
from loomrl.plan.realloc_plan import ReallocPlan
from loomrl.plan.schedule import Schedule, Step, StepKind
from loomrl.role.spec import RoleSpec

__all__ = ["SHARD_FOLLOWS", "CallData", "WorkerPlan", "WorkerSpec"]

SHARD_FOLLOWS = "follows"
"""A streamed item's ``shard``: the chunk's shard is the stream's next item. A worker never puts a shard and
yields its reference inside a streamed item: Ray may free such an object before the call it is passed on to
reads it (the reference-counting race of objects nested in a streaming generator's items, ray-project/ray#58080);
the stream's own items are owned by the controller that reads them."""

Transfer = tuple[str, Allocation, Allocation]
"""``(role, source, destination)`` of a reallocation (both reduced to their shards)."""


@dataclass(frozen=True)
class WorkerSpec:
    """A worker's settings and the roles it may host (the same for every worker of a run)."""

    roles: Mapping[str, RoleSpec]
    task: TaskConfig
    """The task: the reward role's rule, rollout metrics and evaluation score with it."""
    tokenizer: str | None
    """The policy's model, whose tokenizer the run uses as ``task.tokenizer`` and ``task.chat_template`` say
    (:func:`loomrl.models.tokenizer.task_tokenizer`)."""
    seed: int
    device: str = "auto"
    precision: str = "auto"
    threads: int = 0
    """torch threads per worker (0: the machine's cores divided among the workers)."""
    timeout_s: float = 600.0
    """Collective and point-to-point timeout."""
    verify_reallocation: bool = False
    """Check every reallocated shard against its sender's checksum."""
    eval_max_new_tokens: int = 8
    """Response budget of a greedy evaluation."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn rollouts' environment (``rollout.env``), which a greedy evaluation runs episodes with too."""


@dataclass(frozen=True)
class WorkerPlan:
    """What a plan asks of the workers: its schedule, and the transfer plan of every reallocation it makes."""

    schedule: Schedule
    transfers: Mapping[Transfer, ReallocPlan] = field(default_factory=dict)
    """Every ``schedule.transfers()`` entry's plan, planned once by the controller from parameter shapes."""

    def __post_init__(self) -> None:
        missing = [t for t in self.schedule.transfers() if t not in self.transfers]
        if missing:
            role, src, dst = missing[0]
            raise ValueError(f"no transfer plan for {role} from {src.text} to {dst.text}")

    def steps(self) -> dict[str, Step]:
        """Step id → step, over the prologue, the iteration (a fused stage's members too) and the evaluation
        (an id means one step)."""
        schedule = self.schedule
        return {s.id: s for s in (*schedule.prologue, *schedule.steps, *schedule.calls(), *schedule.evaluation)}

    def training(self) -> dict[str, Allocation]:
        """Each trained role's training allocation (its train calls', options included)."""
        return {s.role: s.alloc for s in self.schedule.calls() if s.mfc.kind.value == "train"}

    def offloaded(self) -> set[tuple[str, Allocation]]:
        """The (role, shards) the schedule reloads and offloads around calls."""
        return {(s.role, s.alloc) for s in self.schedule.steps if s.kind is StepKind.RELOAD}

    def shadows(self) -> set[tuple[str, Allocation]]:
        """The (role, shards) of persistent shadow copies (filled by syncs, never freed)."""
        return {(s.role, s.alloc) for s in (*self.schedule.prologue, *self.schedule.steps) if s.kind is StepKind.SYNC}


@dataclass(frozen=True)
class CallData:
    """What the controller sends one worker for one call step: metadata only."""

    iteration: int
    sample_ids: tuple[int, ...]
    """This worker's rows, in order."""
    inputs: tuple[Any, ...]
    """Object references to the output shards holding the rows' input columns (each wrapped in a 1-tuple so
    Ray passes the reference, not its value)."""
    train_steps: tuple[tuple[tuple[int, ...], float], ...] = ()
    """Per optimizer step: positions in ``sample_ids`` and the loss weight (train calls)."""
    publish: bool = True
    """Whether this worker's outputs are published (one tensor-parallel rank per data-parallel group)."""
    partial: PartialRollout | None = None
    """A rollout generate call under partial rollouts: the policy version, where rows pause, and what this
    worker's continued rows generated before (:class:`~loomrl.algorithms.context.PartialRollout`)."""


@dataclass(frozen=True)
class PipelineFusionData:
    """What the controller sends one worker for a ``fused_train`` step: each member call's data, and this
    device's order of one fused pipeline step (:mod:`loomrl.runtime.pipeline_fusion`)."""

    calls: Mapping[str, CallData]
    """Member call id → its data."""
    order: tuple[tuple[int, int, bool], ...]
    """This device's tasks, ``(member index, micro-batch, backward?)``."""
