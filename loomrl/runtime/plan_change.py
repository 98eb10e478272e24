"""Changing the execution plan between iterations: every role's state moved to the new plan's layouts.

:meth:`loomrl.runtime.ray_executor.RayExecutor.apply_plan` takes a new plan; :func:`plan_moves` says what must
move. A trained role whose training allocation changes (devices, layout, FSDP or ZeRO) moves its whole training
state from the old training allocation to the new one with the reallocation machinery (:mod:`loomrl.plan`'s
planner, :mod:`loomrl.parallel.realloc_exec`'s executor): its weights, its fp32 master weights when the weights
are 16-bit, and Adam's moments once it has stepped (:mod:`loomrl.parallel.role_state` names each kind's
tensors on either side), each kind divided as each allocation keeps it. A frozen role's new placements are filled
from one of its old ones. Copies and shadows need nothing: the new schedule's copies refill them before use, and
its prologue fills its shadows. Nothing of the run changes: the next iteration computes what it would have
computed under the old plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from loomrl.plan.allocation import Allocation
from loomrl.plan.realloc_plan import ReallocPlan
from loomrl.role.spec import RoleSpec
from loomrl.runtime.spec import WorkerPlan

__all__ = ["Move", "plan_moves"]

PlanFn = Callable[[str, Allocation, Allocation, bool], ReallocPlan]
"""``(role, source, destination, state)`` → the transfer plan (``state``: of optimizer state)."""


@dataclass(frozen=True)
class Move:
    """One role's state moved from one allocation to another."""

    role: str
    src: Allocation
    dst: Allocation
    kinds: tuple[str, ...]
    """What moves, in order: ``weights``, ``master`` (fp32 master weights), ``exp_avg``, ``exp_avg_sq``."""
    weights: ReallocPlan | None = None
    """The weights' transfer plan (divided as each allocation keeps weights)."""
    state: ReallocPlan | None = None
    """The optimizer state's transfer plan (divided as each allocation keeps optimizer state)."""
    step: int = 0
    """Optimizer steps the role has taken: the destination's moments continue from there."""


def plan_moves(
    old: WorkerPlan,
    new: WorkerPlan,
    specs: Mapping[str, RoleSpec],
    masters: bool,
    steps: Mapping[str, int],
    plan: PlanFn,
) -> list[Move]:
    """The moves that take every role from ``old`` to ``new``, in role order. ``masters``: the weights are
    16-bit, so their fp32 masters move too; ``steps``: each trained role's optimizer steps so far."""
    old_train, new_train = old.training(), new.training()
    old_held, new_held = _holdings(old), _holdings(new)
    moves = []
    for role, spec in specs.items():
        if spec.model is None:
            continue  # a rule-only reward: nothing to move
        if role in new_train:
            src, dst = old_train[role], new_train[role]
            if (src.shards, src.zero) == (dst.shards, dst.zero):
                continue
            moments = ("exp_avg", "exp_avg_sq") if steps.get(role, 0) > 0 else ()
            weights = () if masters and dst.fsdp else ("weights",)  # FSDP's fp32 shards are the masters
            kinds = weights + (("master",) if masters else ()) + moments
            moves.append(
                Move(
                    role,
                    src,
                    dst,
                    kinds,
                    plan(role, src, dst, False) if weights else None,
                    plan(role, src, dst, True) if len(kinds) > len(weights) else None,
                    steps.get(role, 0),
                )
            )
            continue
        for dst in new_held.get(role, ()):
            if dst not in old_held.get(role, ()):
                src = old_held[role][0]
                moves.append(Move(role, src, dst, ("weights",), plan(role, src, dst, False)))
    return moves


def _holdings(plan: WorkerPlan) -> dict[str, list[Allocation]]:
    out: dict[str, list[Allocation]] = {}
    for role, alloc in plan.schedule.holdings():
        out.setdefault(role, []).append(alloc)
    return out
