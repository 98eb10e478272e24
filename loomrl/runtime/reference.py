"""The single-process reference executor: every MFC in this process, in workflow order.

It defines the expected run: every plan, placement, fusion and controller layout must reproduce what this
executor computes from the same seed. It is deliberately plain: no overlap, no sharding, no copies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from loomrl.algorithms.roles import OpContext, Role
from loomrl.checkpoint import load_checkpoint, save_checkpoint
from loomrl.runtime.state_io import FullOptimizerState
from loomrl.workflow import MFC, MFCKind, Workflow
from loomrl.workflow.batch import Batch
from loomrl.workflow.schedule import train_schedule


@dataclass
class MFCTrace:
    """When one MFC ran, and where, for timelines and cost-model calibration."""

    iteration: int
    name: str
    role: str | None
    start: float
    end: float
    devices: tuple[int, ...] = (0,)


@dataclass
class IterationResult:
    stats: dict[str, float] = field(default_factory=dict)
    """Training statistics and rollout metrics, all scalars."""
    traces: list[MFCTrace] = field(default_factory=list)
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
    """Runs a workflow's MFCs one after another on roles held in this process."""

    def __init__(self, workflow: Workflow, roles: dict[str, Role], seed: int, pad_id: int, eos_id: int,
                 decode: Callable[[list[int]], str], metrics_fn: Callable[[Batch], dict] | None = None,
                 evaluate_fn: Callable[[Any, Sequence], dict] | None = None, tokenizer: Any = None):
        missing = sorted({m.role for m in workflow if m.role is not None} - set(roles))
        if missing:
            raise ValueError(f"workflow needs roles {missing} that were not built")
        self.workflow, self.roles = workflow, roles
        self.seed, self.pad_id, self.eos_id, self.decode = seed, pad_id, eos_id, decode
        self.metrics_fn, self.evaluate_fn, self.tokenizer = metrics_fn, evaluate_fn, tokenizer
        self.order = workflow.topological_order()

    def _context(self, mfc: MFC, iteration: int, batch: Batch) -> OpContext:
        role = self.roles[mfc.role] if mfc.role is not None else None
        steps: tuple = ()
        if mfc.kind == MFCKind.TRAIN:
            schedule = train_schedule(response_tokens(batch), mfc.epochs, mfc.minibatches, self.seed, iteration)
            steps = tuple((s.rows_per_rank[0], 1.0) for s in schedule)
        return OpContext(role, self.seed, iteration, self.pad_id, self.eos_id, self.decode, train_steps=steps)

    def run_iteration(self, iteration: int, batch: Batch) -> IterationResult:
        result = IterationResult(batch=batch)
        for mfc in self.order:
            start = time.perf_counter()
            out = mfc.op(self._context(mfc, iteration, batch), batch.columns(mfc.inputs))
            if mfc.kind == MFCKind.TRAIN:
                merge_stats(result.stats, out.pop("stats", {}), mfc.name)
            if set(out) != set(mfc.outputs):
                raise RuntimeError(f"MFC '{mfc.name}' returned {sorted(out)}, declared {sorted(mfc.outputs)}")
            batch.update(out)
            result.traces.append(MFCTrace(iteration, mfc.name, mfc.role, start, time.perf_counter()))
        if self.metrics_fn is not None:
            merge_stats(result.stats, self.metrics_fn(batch), "metrics")
        return result

    # ------------------------------------------------------------------ evaluation and checkpoints
    def trainable(self) -> dict[str, Role]:
        return {name: r for name, r in self.roles.items() if r.optimizer is not None}

    def evaluate(self, examples: Sequence) -> dict[str, float]:
        return self.evaluate_fn(self.roles["actor"].model, examples)

    def save(self, run_dir: Path, iteration: int, state: Mapping[str, Any], keep_last: int) -> Path:
        roles = self.trainable()
        return save_checkpoint(run_dir, iteration, {n: r.model for n, r in roles.items()}, self.tokenizer,
                               {n: FullOptimizerState(r.model, r.optimizer) for n, r in roles.items()}, state,
                               keep_last=keep_last)

    def load(self, path: Path) -> dict[str, Any]:
        roles = self.trainable()
        return load_checkpoint(path, {n: r.model for n, r in roles.items()},
                               {n: FullOptimizerState(r.model, r.optimizer) for n, r in roles.items()})

    def close(self) -> None:
        """Nothing to release in a single process."""
