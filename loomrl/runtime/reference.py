"""The single-process reference executor: every MFC in this process, in workflow order.

It defines the expected run: every plan, placement, fusion and controller layout must reproduce what this
executor computes from the same seed. It is deliberately plain: no overlap, no sharding, no copies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from loomrl.algorithms.context import OpContext, Role
from loomrl.checkpoint.store import load_checkpoint, save_checkpoint, save_sharded_checkpoint
from loomrl.models.tokenizer import encode_prompt
from loomrl.checkpoint.optim_state import FullOptimizerState
from loomrl.plan.schedule import Schedule, Step, StepKind, split_for_sampling
from loomrl.workflow import MFC, MFCKind
from loomrl.workflow.batch import Batch
from loomrl.workflow.minibatches import minibatch_steps

if TYPE_CHECKING:
    from loomrl.algorithms.dynamic_sampling import Waves


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
        return cls(iteration, step.id, step.kind.value, step.role,
                   step.mfc.kind.value if step.kind is StepKind.CALL else None, devices,
                   tuple(metas[d]["start"] for d in devices), tuple(metas[d]["end"] for d in devices), phase)

    @property
    def seconds(self) -> float:
        """From the first device's start to the last one's end."""
        return max(self.end) - min(self.start)

    def to_dict(self) -> dict[str, Any]:
        out = {"iteration": self.iteration, "phase": self.phase, "step": self.step, "kind": self.kind,
               "role": self.role, "mfc_kind": self.mfc_kind, "devices": list(self.devices),
               "start": list(self.start), "end": list(self.end)}
        if self.parts:
            out["parts"] = [list(p) for p in self.parts]
            out["part_kinds"] = dict(self.part_kinds)
        return out


@dataclass
class IterationResult:
    stats: dict[str, float] = field(default_factory=dict)
    """Training statistics and rollout metrics, all scalars."""
    traces: list[StepTrace] = field(default_factory=list)
    """Every step the iteration ran, in the order they ended."""
    batch: Batch | None = None
    """The whole batch, only where it exists in one process (the reference executor)."""


def merge_stats(into: dict[str, float], new: Mapping[str, float], mfc: str) -> None:
    clash = sorted(set(new) & set(into))
    if clash:
        raise RuntimeError(f"MFC '{mfc}' reports statistics {clash} that another MFC already reported")
    into.update(new)


def response_tokens(batch: Batch) -> list[int]:
    """Tokens per sample that train MFCs weight their losses by: the response length (1 per row without one)."""
    if "response_ids" not in batch:
        return [1] * len(batch)
    return [len(r) for r in batch["response_ids"]]


class ReferenceExecutor:
    """Runs a schedule's calls one after another, on roles held in this process; the schedule's other steps
    (reallocations, frees, syncs, offloading) are placement, which one process does not have."""

    def __init__(self, schedule: Schedule, roles: dict[str, Role], seed: int, pad_id: int, eos_id: int,
                 decode: Callable[[list[int]], str], metrics_fn: Callable[[Batch], dict] | None = None,
                 evaluate_fn: Callable[[Any, Sequence], dict] | None = None, tokenizer: Any = None):
        calls = schedule.calls()
        missing = sorted({s.role for s in calls if s.role is not None} - set(roles))
        if missing:
            raise ValueError(f"workflow needs roles {missing} that were not built")
        self.calls, self.roles = calls, roles
        self.seed, self.pad_id, self.eos_id, self.decode = seed, pad_id, eos_id, decode
        self.metrics_fn, self.evaluate_fn, self.tokenizer = metrics_fn, evaluate_fn, tokenizer

    def _context(self, mfc: MFC, iteration: int, batch: Batch) -> OpContext:
        role = self.roles[mfc.role] if mfc.role is not None else None
        steps: tuple = ()
        if mfc.kind == MFCKind.TRAIN:
            schedule = minibatch_steps(response_tokens(batch), mfc.epochs, mfc.minibatches, self.seed, iteration)
            steps = tuple((s.rows_per_rank[0], 1.0) for s in schedule)
        encode = None if self.tokenizer is None else partial(encode_prompt, self.tokenizer)
        return OpContext(role, self.seed, iteration, self.pad_id, self.eos_id, self.decode, encode=encode,
                         train_steps=steps, loss_unit=mfc.loss_unit)

    def run_iteration(self, iteration: int, batch: Batch, waves: Waves | None = None) -> IterationResult:
        """Every call on ``batch``; with ``waves`` (dynamic sampling), ``batch`` is the first wave: the calls that
        make the rewards run on each wave, the others on the samples the waves keep."""
        result = IterationResult(batch=batch)
        calls = self.calls
        if waves is not None:
            head, _, tail = split_for_sampling(self.calls, waves.producer)
            parts = []
            while batch is not None:
                self._run_calls(head, iteration, batch, result)
                parts.append(batch)
                batch = waves.offer(batch.ids, batch[waves.key].tolist())
            whole = Batch.concat(parts)
            index = {sid: i for i, sid in enumerate(whole.ids)}
            batch = result.batch = whole.select([index[s] for s in waves.kept()])
            merge_stats(result.stats, waves.stats(), "dynamic sampling")
            calls = tail
        self._run_calls(calls, iteration, batch, result)
        if self.metrics_fn is not None:
            merge_stats(result.stats, self.metrics_fn(batch), "metrics")
        return result

    def _run_calls(self, calls: Sequence[Step], iteration: int, batch: Batch, result: IterationResult) -> None:
        for step in calls:
            mfc = step.mfc
            start = time.time()
            out = mfc.op(self._context(mfc, iteration, batch), batch.columns(mfc.inputs))
            if mfc.kind == MFCKind.TRAIN:
                merge_stats(result.stats, out.pop("stats", {}), mfc.name)
            if set(out) != set(mfc.outputs):
                raise RuntimeError(f"MFC '{mfc.name}' returned {sorted(out)}, declared {sorted(mfc.outputs)}")
            batch.update(out)
            result.traces.append(StepTrace.of(step, iteration, "iteration", {0: {"start": start, "end": time.time()}}))

    def apply_plan(self, plan: Any) -> None:
        """Nothing moves in one process: a plan change never changes what is computed."""

    def drain_traces(self) -> list[StepTrace]:
        """No steps run outside iterations here."""
        return []

    # ------------------------------------------------------------------ evaluation and checkpoints
    def trainable(self) -> dict[str, Role]:
        return {name: r for name, r in self.roles.items() if r.optimizer is not None}

    def evaluate(self, examples: Sequence) -> dict[str, float]:
        return self.evaluate_fn(self.roles["actor"].model, examples)

    def check_shared_dir(self, path: Path) -> None:
        """One process writes and reads every checkpoint: any directory will do."""

    def save(self, run_dir: Path, iteration: int, state: Mapping[str, Any], keep_last: int,
             sharded: bool = True) -> Path:
        """Checkpoint the trained roles, sharded (one shard per role: the same form the Ray executor writes) or
        whole (``sharded=False``)."""
        roles = self.trainable()
        if sharded:
            return save_sharded_checkpoint(run_dir, iteration, {n: (r.model, r.optimizer) for n, r in roles.items()},
                                           self.tokenizer, state, keep_last=keep_last)
        return save_checkpoint(run_dir, iteration, {n: r.model for n, r in roles.items()}, self.tokenizer,
                               {n: FullOptimizerState(r.model, r.optimizer) for n, r in roles.items()}, state,
                               keep_last=keep_last)

    def load(self, path: Path) -> dict[str, Any]:
        roles = self.trainable()
        return load_checkpoint(path, {n: r.model for n, r in roles.items()},
                               {n: FullOptimizerState(r.model, r.optimizer) for n, r in roles.items()})

    def close(self) -> None:
        """Nothing to release in a single process."""
