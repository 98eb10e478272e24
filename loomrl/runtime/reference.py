"""The single-process reference executor: every MFC in this process, in workflow order.

It defines the expected run: every plan, placement, fusion and controller layout must reproduce what this
executor computes from the same seed. It is deliberately plain: no overlap, no sharding, no copies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from loomrl.algorithms.roles import OpContext, Role
from loomrl.workflow import MFC, MFCKind, Workflow
from loomrl.workflow.batch import Batch


@dataclass
class MFCTrace:
    """When one MFC ran, for timelines and cost-model calibration."""

    iteration: int
    name: str
    role: str | None
    start: float
    end: float


@dataclass
class IterationResult:
    batch: Batch
    stats: dict[str, float] = field(default_factory=dict)
    traces: list[MFCTrace] = field(default_factory=list)


class ReferenceExecutor:
    """Runs a workflow's MFCs one after another on roles held in this process."""

    def __init__(self, workflow: Workflow, roles: dict[str, Role], seed: int, pad_id: int, eos_id: int,
                 decode: Callable[[list[int]], str]):
        missing = sorted({m.role for m in workflow if m.role is not None} - set(roles))
        if missing:
            raise ValueError(f"workflow needs roles {missing} that were not built")
        self.workflow, self.roles = workflow, roles
        self.seed, self.pad_id, self.eos_id, self.decode = seed, pad_id, eos_id, decode
        self.order = workflow.topological_order()

    def _context(self, mfc: MFC, iteration: int) -> OpContext:
        role = self.roles[mfc.role] if mfc.role is not None else None
        return OpContext(role, self.seed, iteration, self.pad_id, self.eos_id, self.decode)

    def run_iteration(self, iteration: int, batch: Batch) -> IterationResult:
        result = IterationResult(batch)
        for mfc in self.order:
            start = time.perf_counter()
            out = mfc.op(self._context(mfc, iteration), batch.columns(mfc.inputs))
            if mfc.kind == MFCKind.TRAIN:
                stats = out.pop("stats", {})
                clash = sorted(set(stats) & set(result.stats))
                if clash:
                    raise RuntimeError(f"MFC '{mfc.name}' reports statistics {clash} that another MFC already reported")
                result.stats.update(stats)
            if set(out) != set(mfc.outputs):
                raise RuntimeError(f"MFC '{mfc.name}' returned {sorted(out)}, declared {sorted(mfc.outputs)}")
            batch.update(out)
            result.traces.append(MFCTrace(iteration, mfc.name, mfc.role, start, time.perf_counter()))
        return result
