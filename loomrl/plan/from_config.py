"""The execution plan a run's ``runtime`` settings ask for: a strategy, a plan string or file, or the colocated
default with ``runtime.layouts``. The trainer and the planner's run readers resolve plans here alike."""

from __future__ import annotations

import dataclasses

from loomrl.config.schema import RuntimeConfig
from loomrl.errors import ConfigError
from loomrl.plan.cluster import ClusterSpec
from loomrl.plan.layout import Layout
from loomrl.plan.plan import ExecutionPlan
from loomrl.plan.strategies import colocate, make_plan
from loomrl.workflow import MFCKind, Workflow

__all__ = ["plan_from_config", "resolve_layouts"]


def resolve_layouts(runtime: RuntimeConfig, workflow: Workflow, n: int) -> dict[str, Layout]:
    """Layouts for colocate over ``n`` devices, keyed by role (and by generate MFC where a role is pipelined:
    generation runs with pp=1, the plan's reallocation moving the weights)."""
    out: dict[str, Layout] = {}
    for role in workflow.roles():
        given = runtime.layouts.get(role)
        tp, pp = (given.tp, given.pp) if given else (1, 1)
        dp = given.dp if given and given.dp else n // (tp * pp)
        if dp * tp * pp != n:
            raise ConfigError(
                f"runtime.layouts.{role}: dp {dp} x tp {tp} x pp {pp} = {dp * tp * pp} does not match the {n} devices"
            )
        out[role] = Layout(dp=dp, tp=tp, pp=pp)
        if pp > 1:
            for mfc in workflow.mfcs_of_role(role):
                if mfc.kind == MFCKind.GENERATE:
                    out[mfc.name] = Layout(dp=n // tp, tp=tp)
    return out


def plan_from_config(
    runtime: RuntimeConfig, workflow: Workflow, cluster: ClusterSpec, plan: str | None = None
) -> ExecutionPlan:
    """``plan`` (by default ``runtime.plan``) if given, else every call on all devices with ``runtime.layouts``
    (colocate; a role's ``sharding`` applies to its train calls). Generation needs pp = 1."""
    text = runtime.plan if plan is None else plan
    if text is not None:
        result = make_plan(text, workflow, cluster)
    else:
        result = colocate(workflow, cluster, layouts=resolve_layouts(runtime, workflow, cluster.n_devices))
        for mfc in workflow.topological_order():
            given = runtime.layouts.get(mfc.model_role) if mfc.kind == MFCKind.TRAIN else None
            if given is not None and given.sharding != "none":
                result = result.with_allocation(
                    mfc.name,
                    dataclasses.replace(result[mfc.name], zero=given.sharding == "zero", fsdp=given.sharding == "fsdp"),
                )
    for mfc in workflow.topological_order():
        if mfc.kind == MFCKind.GENERATE and result[mfc.name].layout.pp > 1:
            raise ConfigError(
                f"runtime.plan: MFC '{mfc.name}' generates with pp={result[mfc.name].layout.pp}; "
                "generation runs with pp=1 (the plan's reallocation moves the weights into that layout)"
            )
    return result
