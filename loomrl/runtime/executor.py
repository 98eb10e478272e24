"""The seam between the trainer and the executors: what a run may ask of an executor, and what it gets back.

:class:`Executor` is all the trainer (:class:`~loomrl.train.rl.RLTrainer`), its recovery and dynamic placement
(:class:`~loomrl.train.dynamic_placement.DynamicPlacement`) call of an executor. Two executors implement it:
:class:`~loomrl.runtime.reference.ReferenceExecutor` (every call in one process: the expected run) and
:class:`~loomrl.runtime.ray_executor.RayExecutor` (one Ray worker per device). What a run observes comes back as
values that cross the seam: each iteration's :class:`IterationResult` (statistics, traces, response lengths) and
the :class:`StepTrace` of steps run between iterations; nothing reads an executor's attributes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from loomrl.plan.schedule import Step, StepKind
from loomrl.workflow.batch import Batch

if TYPE_CHECKING:
    from loomrl.algorithms.dynamic_sampling import Waves
    from loomrl.plan.plan import ExecutionPlan

__all__ = ["Executor", "IterationResult", "StepTrace", "merge_stats", "staleness_stats", "version_summary"]


@dataclass
class StepTrace:
    """When one schedule step ran on each of its devices, for timelines, calibration and order checks."""

    iteration: int
    step: str
    """The step's id in its schedule (the MFC's name for a call)."""
    kind: str
    """The step's kind: call, copy, free, sync, reload, offload or evaluate."""
    role: str | None
    mfc_kind: str | None
    """A call's MFC kind (generate, inference, train, compute); None for other steps."""
    devices: tuple[int, ...]
    start: tuple[float, ...]
    """Per device of ``devices``: wall-clock seconds (``time.time()``) when the step started there."""
    end: tuple[float, ...]
    phase: str = "iteration"
    """``iteration``, ``prologue`` (before the first iteration, after a load or a plan change) or ``evaluation``."""
    parts: tuple[tuple[str, int, float, float], ...] = ()
    """A fused stage's parts: ``(label, device, start, end)`` of its generation, migration and member calls."""
    part_kinds: Mapping[str, str] = field(default_factory=dict)
    """A part's label → what it is: an MFC kind (``generate``, ``inference``) or ``migrate``."""

    @classmethod
    def of(cls, step: Step, iteration: int, phase: str, metas: Mapping[int, Mapping[str, Any]]) -> StepTrace:
        """The trace of ``step`` from each device's reply (``start``, ``end``)."""
        devices = tuple(sorted(metas))
        return cls(
            iteration,
            step.id,
            step.kind.value,
            step.role,
            step.mfc.kind.value if step.kind is StepKind.CALL else None,
            devices,
            tuple(metas[d]["start"] for d in devices),
            tuple(metas[d]["end"] for d in devices),
            phase,
        )

    @property
    def seconds(self) -> float:
        """From the first device's start to the last one's end."""
        return max(self.end) - min(self.start)

    def to_dict(self) -> dict[str, Any]:
        """The trace as one line of ``traces.jsonl``."""
        out = {
            "iteration": self.iteration,
            "phase": self.phase,
            "step": self.step,
            "kind": self.kind,
            "role": self.role,
            "mfc_kind": self.mfc_kind,
            "devices": list(self.devices),
            "start": list(self.start),
            "end": list(self.end),
        }
        if self.parts:
            out["parts"] = [list(p) for p in self.parts]
            out["part_kinds"] = dict(self.part_kinds)
        return out


@dataclass
class IterationResult:
    """What one iteration observed, handed to the trainer (and through it to dynamic placement)."""

    stats: dict[str, float] = field(default_factory=dict)
    """Training statistics and rollout metrics, all scalars."""
    traces: list[StepTrace] = field(default_factory=list)
    """Every step the iteration ran, in the order they ended."""
    response_lengths: list[int] = field(default_factory=list)
    """Every sample's response length, in batch order (with dynamic sampling: the samples the waves kept): the
    workload the run observed."""
    batch: Batch | None = None
    """The whole batch, only where it exists in one process (the reference executor)."""


def merge_stats(into: dict[str, float], new: Mapping[str, float], mfc: str) -> None:
    """Add ``new`` (reported by ``mfc``) to ``into``; a statistic two reporters both name is an error."""
    clash = sorted(set(new) & set(into))
    if clash:
        raise RuntimeError(f"MFC '{mfc}' reports statistics {clash} that another MFC already reported")
    into.update(new)


def version_summary(versions: Sequence[int]) -> tuple[int, int, int]:
    """(oldest, sum, count) of the policy versions that sampled a batch's tokens (or a shard's): what
    :func:`staleness_stats` reads, summed over shards."""
    return (min(versions, default=0), sum(versions), len(versions))


def staleness_stats(iteration: int, summaries: Sequence[tuple[int, int, int]]) -> dict[str, float]:
    """How many policy versions the sampler of ``iteration``'s batch is behind the policy it trains, from the
    :func:`version_summary` of each shard's token versions (one version for the whole batch where one generated
    it all; under partial rollouts every token's): the largest gap (what ``max_staleness`` bounds) and the mean
    over tokens."""
    parts = [s for s in summaries if s[2]]
    if not parts:
        return {"async/staleness": 0.0, "async/staleness_mean": 0.0}
    total, count = sum(s[1] for s in parts), sum(s[2] for s in parts)
    return {
        "async/staleness": float(iteration - min(s[0] for s in parts)),
        "async/staleness_mean": float(iteration - total / count),
    }


GENERATED_AHEAD = "generated_ahead"
"""The key of a loaded run state that lists the iterations of the batches generated ahead it restored."""


class Executor(Protocol):
    """Runs a workflow's schedule under an execution plan: all the trainer, its recovery and dynamic placement
    may call of an executor. Every plan computes the same run; only where and when it computes differs."""

    def run_iteration(
        self, iteration: int, batch: Batch, waves: Waves | None = None, ahead: tuple[int, Batch] | None = None
    ) -> IterationResult:
        """Run one iteration's steps on ``batch`` (with ``waves``, dynamic sampling: its first wave); under an
        asynchronous plan its rollout generation runs on ``ahead`` (a later iteration and its prompts) and
        ``batch`` takes what was generated for it earlier."""
        ...

    def generate_ahead(self, iteration: int, batch: Batch, version: int) -> None:
        """Asynchronous plans: generate ``batch``, the prompts of ``iteration``, now with the current weights
        (policy ``version``) and keep it for that iteration (the pipeline's fill)."""
        ...

    def evaluate(self, examples: Sequence) -> dict[str, float]:
        """Greedy evaluation of the actor on ``examples``: each score's mean over them."""
        ...

    def save(
        self, run_dir: Path, iteration: int, state: Mapping[str, Any], keep_last: int, sharded: bool = True
    ) -> Path:
        """Checkpoint the trained roles with the run's ``state`` in ``run_dir``, keeping the ``keep_last`` latest."""
        ...

    def load(self, path: Path) -> dict[str, Any]:
        """Load the checkpoint at ``path`` into the trained roles; returns the run state saved with it and, under
        :data:`GENERATED_AHEAD`, the iterations whose batches an asynchronous run had generated ahead (restored
        with it)."""
        ...

    def apply_plan(self, plan: ExecutionPlan) -> None:
        """Continue under ``plan`` on the same devices, computing exactly what the old plan would have."""
        ...

    def drain_traces(self) -> list[StepTrace]:
        """The traces of steps run outside iterations since the last call (the caller stamps their iteration)."""
        ...

    def check_shared_dir(self, path: Path) -> None:
        """Fail unless every process that writes or reads checkpoints sees directory ``path``."""
        ...

    def close(self) -> None:
        """Release every process and device the executor holds; safe to call after a failure or twice."""
        ...
