"""From an execution plan to what the runtime executes: allocation keys per MFC, canonical weights per role,
and the parameter transfers between a role's allocations (planned once, before any worker starts)."""

from __future__ import annotations

import dataclasses

from loomrl.config import TrainConfig
from loomrl.errors import ConfigError
from loomrl.models.zoo import parameter_shapes
from loomrl.parallel.allocations import AllocKey
from loomrl.plan import ClusterSpec, ExecutionPlan, colocate, make_plan, plan_reallocation
from loomrl.plan.layout import Layout
from loomrl.runtime.worker import RuntimePlacement
from loomrl.workflow import MFCKind, Workflow


def resolve_layouts(cfg: TrainConfig, workflow: Workflow, n: int) -> dict[str, Layout]:
    """Layouts for colocate over ``n`` devices, keyed by role (and by generate MFC where a role is pipelined:
    generation runs with pp=1, the plan's reallocation moving the weights)."""
    out: dict[str, Layout] = {}
    for role in workflow.roles():
        given = cfg.runtime.layouts.get(role)
        tp, pp = (given.tp, given.pp) if given else (1, 1)
        dp = given.dp if given and given.dp else n // (tp * pp)
        if dp * tp * pp != n:
            raise ConfigError(f"runtime.layouts.{role}: dp {dp} x tp {tp} x pp {pp} = {dp * tp * pp} does not "
                              f"match the {n} devices")
        out[role] = Layout(dp=dp, tp=tp, pp=pp)
        if pp > 1:
            for mfc in workflow.mfcs_of_role(role):
                if mfc.kind == MFCKind.GENERATE:
                    out[mfc.name] = Layout(dp=n // tp, tp=tp)
    return out


def execution_plan(cfg: TrainConfig, workflow: Workflow, cluster: ClusterSpec) -> ExecutionPlan:
    """``runtime.plan`` if given, else every call on all devices with ``runtime.layouts`` (colocate; a role's
    ``sharding`` applies to its train calls)."""
    if cfg.runtime.plan is not None:
        return make_plan(cfg.runtime.plan, workflow, cluster)
    plan = colocate(workflow, cluster, layouts=resolve_layouts(cfg, workflow, cluster.n_devices))
    for mfc in workflow.topological_order():
        given = cfg.runtime.layouts.get(mfc.role) if mfc.kind == MFCKind.TRAIN else None
        if given is not None and given.sharding != "none":
            plan = plan.with_allocation(mfc.name, dataclasses.replace(
                plan[mfc.name], zero=given.sharding == "zero", fsdp=given.sharding == "fsdp"))
    return plan


def _key(alloc) -> AllocKey:
    return AllocKey(tuple(alloc.mesh.devices), alloc.layout.dp, alloc.layout.tp, alloc.layout.pp, alloc.fsdp)


def param_shapes(cfg: TrainConfig, role: str, tokenizer) -> tuple[dict[str, tuple[int, ...]], int] | None:
    """Full parameter shapes and layer count of a role's model, from its config alone (no weights)."""
    spec = {"actor": cfg.actor.model, "ref": cfg.actor.model, "critic": cfg.critic.model or cfg.actor.model,
            "reward": cfg.reward.model if cfg.reward.source in ("model", "both") else None}[role]
    if spec is None:
        return None
    return parameter_shapes(spec, tokenizer, value=role in ("critic", "reward"))


def runtime_placement(plan: ExecutionPlan, workflow: Workflow, cluster: ClusterSpec, cfg: TrainConfig,
                      tokenizer) -> RuntimePlacement:
    """Each MFC's allocation, micro-batches and activation recompute, each role's canonical allocation (and
    whether its optimizer state is sharded), and the transfers between a role's allocations."""
    mfc_keys = {m.name: _key(plan[m.name]) for m in workflow.topological_order()}
    for m in workflow.topological_order():
        if m.kind == MFCKind.GENERATE and mfc_keys[m.name].pp > 1:
            raise ConfigError(f"runtime.plan: MFC '{m.name}' generates with pp={mfc_keys[m.name].pp}; generation "
                              "runs with pp=1 (the plan's reallocation moves the weights into that layout)")
    canonical = {}
    for role in workflow.roles():
        train = plan.canonical_layout(workflow, role)
        first = next(m for m in workflow.topological_order() if m.role == role)
        canonical[role] = _key(train) if train is not None else mfc_keys[first.name]
    reallocs = []
    for role in workflow.roles():
        others = sorted({mfc_keys[m.name] for m in workflow.mfcs_of_role(role)} - {canonical[role]})
        shapes = param_shapes(cfg, role, tokenizer) if others else None
        for key in others if shapes is not None else ():
            src, dst = canonical[role], key
            transfer = plan_reallocation(shapes[0], shapes[1], (src.devices, src.layout, src.fsdp),
                                         (dst.devices, dst.layout), cluster.node_of)
            reallocs.append((role, src, dst, transfer))
    micro_batches = {m.name: plan[m.name].micro_batches for m in workflow.topological_order()}
    recompute = frozenset(m.name for m in workflow.topological_order() if plan[m.name].recompute)
    zero = frozenset(role for role in workflow.roles()
                     if (train := plan.canonical_layout(workflow, role)) is not None and train.zero)
    return RuntimePlacement(mfc_keys, canonical, tuple(reallocs), micro_batches, recompute,
                            frozenset(plan.offloaded_roles(workflow)), zero)


def trained_roles(workflow: Workflow) -> set[str]:
    return {m.role for m in workflow if m.kind == MFCKind.TRAIN}
